"""Avro records to Confluent-framed bytes and back, with the writer schema kept in the registry.

``AvroDeserializer`` decodes with the *writer's* schema (found by the id in the frame) and resolves into an
optional *reader* schema, Avro's schema-evolution rules applied by fastavro: fields the writer lacked get the
reader's defaults, fields the reader lacks are dropped. Every way a message can be bad raises a subclass of
``AvroDecodeError`` whose ``code`` names the reason (used as the dead-letter reason by ``DecodeAvro``).
"""

from __future__ import annotations

import io
import threading
import time
from typing import Any

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError

from beamflow.avro.registry import SchemaNotFoundError, SchemaRegistryClient
from beamflow.avro.wire import WireFormatError, decode_frame, encode_frame

__all__ = [
    "AvroDecodeError",
    "AvroDeserializer",
    "AvroSerializer",
    "CorruptBodyError",
    "NullValueError",
    "ResolutionError",
    "TrailingBytesError",
    "TruncatedBodyError",
    "UnknownSchemaError",
    "WireError",
]


class AvroDecodeError(ValueError):
    """A message could not be decoded; ``code`` is a short stable reason, the message the details."""

    code = "decode_error"

    def __init__(self, message: str, schema_id: int | None = None) -> None:
        super().__init__(message)
        self.schema_id = schema_id


class NullValueError(AvroDecodeError):
    code = "null_value"


class WireError(AvroDecodeError):
    """Bad framing; ``code`` is the wire error's own (bad_magic_byte, truncated_header, empty_body)."""

    def __init__(self, cause: WireFormatError) -> None:
        super().__init__(str(cause))
        self.code = cause.code


class UnknownSchemaError(AvroDecodeError):
    code = "unknown_schema_id"


class TruncatedBodyError(AvroDecodeError):
    code = "truncated_body"


class TrailingBytesError(AvroDecodeError):
    code = "trailing_bytes"


class CorruptBodyError(AvroDecodeError):
    code = "corrupt_body"


class ResolutionError(AvroDecodeError):
    code = "schema_resolution"


class AvroSerializer:
    """Encodes records with one writer schema registered under ``subject``.

    The schema is registered (or, with ``auto_register=False``, looked up) once, on first use.
    """

    def __init__(
        self,
        client: SchemaRegistryClient,
        subject: str,
        schema: dict[str, Any],
        auto_register: bool = True,
    ) -> None:
        self.client = client
        self.subject = subject
        self.schema = schema
        self.auto_register = auto_register
        self._parsed = parse_schema(schema)
        self._schema_id: int | None = None

    @property
    def schema_id(self) -> int:
        if self._schema_id is None:
            if self.auto_register:
                self._schema_id = self.client.register(self.subject, self.schema)
            else:
                self._schema_id = self.client.lookup(self.subject, self.schema).schema_id
        return self._schema_id

    def encode_body(self, record: dict[str, Any]) -> bytes:
        out = io.BytesIO()
        schemaless_writer(out, self._parsed, record)
        return out.getvalue()

    def serialize(self, record: dict[str, Any]) -> bytes:
        return encode_frame(self.schema_id, self.encode_body(record))


class AvroDeserializer:
    """Decodes Confluent-framed Avro, resolving every writer schema into ``reader_schema`` when one is given.

    Writer schemas are fetched once per id and kept parsed. An id the registry does not know is remembered for
    ``unknown_id_ttl`` seconds so a stream of such records does not become a stream of registry calls.
    """

    def __init__(
        self,
        client: SchemaRegistryClient,
        reader_schema: dict[str, Any] | None = None,
        unknown_id_ttl: float = 30.0,
    ) -> None:
        self.client = client
        self.reader_schema = reader_schema
        self._reader = parse_schema(reader_schema) if reader_schema is not None else None
        self._writers: dict[int, Any] = {}
        self._unknown: dict[int, tuple[float, str]] = {}
        self._lock = threading.Lock()
        self.unknown_id_ttl = unknown_id_ttl

    def writer_schema(self, schema_id: int) -> Any:
        """The parsed writer schema for ``schema_id``; ``UnknownSchemaError`` if the registry lacks it."""
        parsed = self._writers.get(schema_id)
        if parsed is not None:
            return parsed
        now = time.monotonic()
        with self._lock:
            miss = self._unknown.get(schema_id)
        if miss is not None and now - miss[0] < self.unknown_id_ttl:
            raise UnknownSchemaError(miss[1], schema_id)
        try:
            schema = self.client.get_schema(schema_id)
        except SchemaNotFoundError as exc:
            reason = f"schema id {schema_id} is not in the registry ({exc})"
            with self._lock:
                self._unknown[schema_id] = (now, reason)
            raise UnknownSchemaError(reason, schema_id) from exc
        parsed = parse_schema(schema)
        with self._lock:
            self._writers[schema_id] = parsed
        return parsed

    def deserialize(self, data: bytes | None) -> dict[str, Any]:
        """Decodes one message. A registry outage raises ``RegistryUnavailableError`` (retry), not a
        decode error."""
        if data is None:
            raise NullValueError("message value is null (a tombstone or an empty produce)")
        try:
            frame = decode_frame(data)
        except WireFormatError as exc:
            raise WireError(exc) from exc
        writer = self.writer_schema(frame.schema_id)
        buffer = io.BytesIO(frame.body)
        try:
            record = schemaless_reader(buffer, writer, self._reader)
        except SchemaResolutionError as exc:
            raise ResolutionError(
                f"data written with schema id {frame.schema_id} cannot be read with the reader schema: {exc}",
                frame.schema_id,
            ) from exc
        except EOFError as exc:
            # fastavro reports a negative length prefix as "Expected -N bytes": garbage, not truncation.
            if "Expected -" in str(exc):
                raise CorruptBodyError(
                    f"body does not decode with schema id {frame.schema_id}: negative length ({exc})",
                    frame.schema_id,
                ) from exc
            raise TruncatedBodyError(
                f"body ends early for schema id {frame.schema_id} ({len(frame.body)} bytes): {exc or 'EOF'}",
                frame.schema_id,
            ) from exc
        except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as exc:
            raise CorruptBodyError(
                f"body does not decode with schema id {frame.schema_id}: {type(exc).__name__}: {exc}",
                frame.schema_id,
            ) from exc
        consumed = buffer.tell()
        if consumed != len(frame.body):
            raise TrailingBytesError(
                f"schema id {frame.schema_id} decodes {consumed} of {len(frame.body)} body bytes; "
                f"{len(frame.body) - consumed} bytes are left over (wrong schema id or corrupt message)",
                frame.schema_id,
            )
        if not isinstance(record, dict):
            raise CorruptBodyError(
                f"schema id {frame.schema_id} is not a record schema (decoded a {type(record).__name__})",
                frame.schema_id,
            )
        return record
