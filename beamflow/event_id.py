"""Deterministic event ids: a stable 128-bit hash rendered as a UUID string. No Beam.

BLAKE2b over a canonical encoding, so the id is identical across processes, machines, Python versions and
``PYTHONHASHSEED`` values (Python's ``hash()`` is none of those). Two sources:

- Kafka coordinates (topic, partition, offset): unique per produced record; a replayed *read* gets the same id, a
  producer's duplicate *send* gets a new one.
- Named payload fields (e.g. user_id, ad_id, event_time): the same business event sent twice gets the same id, which
  is what deduplication of producer retries needs.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["event_id_from_coordinates", "event_id_from_fields"]


def _uuid(namespace: bytes, payload: bytes) -> str:
    digest = hashlib.blake2b(payload, digest_size=16, person=namespace).digest()
    return str(uuid.UUID(bytes=digest))


def event_id_from_coordinates(topic: str, partition: int, offset: int) -> str:
    return _uuid(b"beamflow.kafka", f"{topic}\x00{partition}\x00{offset}".encode())


def _canonical(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 1.0 and 1 are the same event field
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def event_id_from_fields(record: Mapping[str, Any], fields: Sequence[str]) -> str:
    missing = [f for f in fields if f not in record]
    if missing:
        raise KeyError(f"event id fields missing from record: {', '.join(missing)}")
    canonical = json.dumps([[f, _canonical(record[f])] for f in fields], separators=(",", ":"), sort_keys=False)
    return _uuid(b"beamflow.fields", canonical.encode())
