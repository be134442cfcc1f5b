"""The Confluent wire format: one magic byte 0, a 4-byte big-endian schema id, then the Avro binary body.

Only the framing lives here (no schema knowledge, no network), so it is cheap to test and to reuse from any
serializer. Every malformed frame raises a subclass of ``WireFormatError`` saying exactly what is wrong.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = [
    "HEADER_SIZE",
    "MAGIC_BYTE",
    "BadMagicByteError",
    "EmptyBodyError",
    "Frame",
    "TruncatedHeaderError",
    "WireFormatError",
    "decode_frame",
    "encode_frame",
]

MAGIC_BYTE = 0
HEADER_SIZE = 5
_HEADER = struct.Struct(">BI")
_MAX_SCHEMA_ID = 2**31 - 1  # Confluent ids are signed 32-bit ints on the Java side


class WireFormatError(ValueError):
    """The bytes are not a valid Confluent-framed message. ``code`` is a short machine-readable reason."""

    code = "wire_format"


class TruncatedHeaderError(WireFormatError):
    code = "truncated_header"


class BadMagicByteError(WireFormatError):
    code = "bad_magic_byte"


class EmptyBodyError(WireFormatError):
    code = "empty_body"


@dataclass(frozen=True)
class Frame:
    """A decoded frame: the writer's schema id and the Avro body (not yet decoded)."""

    schema_id: int
    body: bytes


def encode_frame(schema_id: int, body: bytes) -> bytes:
    """Frames an Avro body written with schema ``schema_id``."""
    if not 0 <= schema_id <= _MAX_SCHEMA_ID:
        raise ValueError(f"schema id {schema_id} is outside 0..{_MAX_SCHEMA_ID}")
    return _HEADER.pack(MAGIC_BYTE, schema_id) + body


def decode_frame(data: bytes | bytearray | memoryview, allow_empty_body: bool = False) -> Frame:
    """Splits a framed message into schema id and body.

    An empty body is refused by default: no Avro record schema beamflow uses encodes to zero bytes, so an
    empty body means the producer wrote only the header. A truncated *non-empty* body can only be detected
    by decoding it against its schema (see ``beamflow.avro.serde``).
    """
    raw = bytes(data)
    if len(raw) < HEADER_SIZE:
        if raw and raw[0] != MAGIC_BYTE:
            raise BadMagicByteError(
                f"first byte is 0x{raw[0]:02x}, expected magic byte 0x00 (message is {len(raw)} bytes)"
            )
        raise TruncatedHeaderError(f"message is {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, schema_id = _HEADER.unpack_from(raw)
    if magic != MAGIC_BYTE:
        raise BadMagicByteError(f"first byte is 0x{raw[0]:02x}, expected magic byte 0x00")
    body = raw[HEADER_SIZE:]
    if not body and not allow_empty_body:
        raise EmptyBodyError(f"message has the header (schema id {schema_id}) but no Avro body")
    return Frame(schema_id=schema_id, body=body)
