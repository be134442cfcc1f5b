"""Avro over the Confluent wire format: framing, a schema-registry client, serializers and schema evolution.

No Beam here; ``transforms.decode_avro.DecodeAvro`` wraps the deserializer for pipelines.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

__all__ = ["load_schema"]


def load_schema(name: str) -> dict[str, Any]:
    """A schema shipped with beamflow, e.g. ``load_schema("click_v2")`` reads ``schemas/click_v2.avsc``."""
    text = resources.files("beamflow.avro").joinpath("schemas", f"{name}.avsc").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema
