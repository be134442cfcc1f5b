"""The record every beamflow stage emits instead of dropping an input it cannot handle.

A dead letter keeps the original bytes (or a faithful encoding of the element), where it came from in Kafka
when that is known, which stage rejected it and why, so it can be inspected, fixed and replayed. Nothing is
silently dropped.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DeadLetter", "encode_payload"]


def encode_payload(element: Any) -> bytes:
    """Bytes for an element: bytes as they are, str as UTF-8, anything else as JSON (non-JSON values via
    ``str``)."""
    if isinstance(element, bytes | bytearray | memoryview):
        return bytes(element)
    if isinstance(element, str):
        return element.encode("utf-8")
    return json.dumps(element, default=_json_default, sort_keys=True, ensure_ascii=False).encode("utf-8")


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return value
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


@dataclass(frozen=True)
class DeadLetter:
    """One rejected input: its raw payload, its Kafka coordinates if known, the stage that rejected it and
    why.

    ``reason`` is human-readable (for database errors it carries the database's own message); ``error`` is a
    short machine-readable code such as a SQLSTATE or an exception class name.
    """

    payload: bytes
    stage: str
    reason: str
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None
    key: bytes | None = None
    error: str | None = None
    attributes: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (bytes as base64), e.g. to publish to a dead-letter topic."""
        out = asdict(self)
        out["payload"] = base64.b64encode(self.payload).decode("ascii")
        out["key"] = base64.b64encode(self.key).decode("ascii") if self.key is not None else None
        out["attributes"] = dict(self.attributes)
        return out

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode("utf-8")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeadLetter:
        values = dict(data)
        values["payload"] = base64.b64decode(values["payload"])
        if values.get("key") is not None:
            values["key"] = base64.b64decode(values["key"])
        values["attributes"] = tuple(sorted((values.get("attributes") or {}).items()))
        return cls(**values)
