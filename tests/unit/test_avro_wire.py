"""Confluent framing: byte 0, big-endian schema id, body; every malformed frame has its own error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from beamflow.avro.wire import (
    BadMagicByteError,
    EmptyBodyError,
    TruncatedHeaderError,
    WireFormatError,
    decode_frame,
    encode_frame,
)

pytestmark = pytest.mark.unit


def test_frame_layout_is_magic_then_big_endian_id() -> None:
    assert encode_frame(258, b"\x02ab") == b"\x00\x00\x00\x01\x02\x02ab"


@given(st.integers(min_value=0, max_value=2**31 - 1), st.binary(min_size=1, max_size=64))
def test_round_trip(schema_id: int, body: bytes) -> None:
    frame = decode_frame(encode_frame(schema_id, body))
    assert (frame.schema_id, frame.body) == (schema_id, body)


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x00\x00\x00\x01"])
def test_short_messages_are_truncated_headers(data: bytes) -> None:
    with pytest.raises(TruncatedHeaderError, match="shorter than the 5-byte header"):
        decode_frame(data)


@pytest.mark.parametrize("data", [b"\x01\x00\x00\x00\x01\x02", b'{"json": true}', b"\xff"])
def test_wrong_first_byte_is_bad_magic(data: bytes) -> None:
    with pytest.raises(BadMagicByteError, match="expected magic byte 0x00") as info:
        decode_frame(data)
    assert info.value.code == "bad_magic_byte"


def test_header_without_body() -> None:
    with pytest.raises(EmptyBodyError, match="schema id 7"):
        decode_frame(b"\x00\x00\x00\x00\x07")
    assert decode_frame(b"\x00\x00\x00\x00\x07", allow_empty_body=True).body == b""


def test_errors_share_a_base_and_distinct_codes() -> None:
    codes = {cls.code for cls in (BadMagicByteError, EmptyBodyError, TruncatedHeaderError)}
    assert len(codes) == 3
    assert all(issubclass(c, WireFormatError) for c in (BadMagicByteError, EmptyBodyError, TruncatedHeaderError))


@pytest.mark.parametrize("schema_id", [-1, 2**31])
def test_out_of_range_ids_are_refused(schema_id: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        encode_frame(schema_id, b"x")
