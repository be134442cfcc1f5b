"""Flink's key-group assignment in Python, against values Flink's own classes computed.

The golden rows were printed by Flink 1.19.3 itself, with the ``flink-dist`` jar that ``beamflow services up flink``
installs on the classpath (``java -cp .cache/flink-1.19.3/lib/flink-dist-1.19.3.jar Golden.java``)::

    byte[] b = <the row's bytes>;
    System.out.println(ByteBuffer.wrap(b).hashCode());
    for (int[] s : new int[][] {{128, 2}, {128, 3}, {256, 5}, {32768, 7}})
        System.out.println(KeyGroupRangeAssignment.assignKeyToParallelOperator(ByteBuffer.wrap(b), s[0], s[1]));
    System.out.println(KeyGroupRangeAssignment.computeDefaultMaxParallelism(p));  // for each p below
"""

from __future__ import annotations

import pytest

from beamflow.flink_keys import _byte_buffer_hash, default_max_parallelism, length_prefixed, subtask_of_key

# (key bytes as hex, ByteBuffer.hashCode(), subtask at (128, 2), (128, 3), (256, 5), (32768, 7))
GOLDEN = [
    ("", 1, 1, 2, 4, 3),
    ("00", 31, 1, 2, 2, 0),
    ("7f80ff", 24989, 1, 1, 4, 4),
    ("0b64726f702d746f706963", 38835195, 1, 1, 1, 4),
    ("ff800595", -2263280, 1, 2, 4, 5),
    ("0102030405060708090a0b0c0d0e0f10", 1672707577, 1, 1, 3, 4),
]
SHAPES = [(128, 2), (128, 3), (256, 5), (32768, 7)]


@pytest.mark.parametrize("row", GOLDEN, ids=[row[0] or "empty" for row in GOLDEN])
def test_subtasks_match_flinks_own_assignment(row: tuple) -> None:
    key = bytes.fromhex(row[0])
    assert _byte_buffer_hash(key) == row[1]
    assert [subtask_of_key(key, m, p) for m, p in SHAPES] == list(row[2:])


def test_default_max_parallelism_matches_flink() -> None:
    expected = {1: 128, 2: 128, 4: 128, 85: 128, 86: 256, 100: 256, 1000: 2048, 30000: 32768}
    assert {p: default_max_parallelism(p) for p in expected} == expected


def test_length_prefix_is_a_varint() -> None:
    assert length_prefixed(b"ab") == b"\x02ab"
    assert length_prefixed(b"x" * 300)[:2] == b"\xac\x02"


def test_a_parallelism_above_the_max_is_refused() -> None:
    with pytest.raises(ValueError, match="max_parallelism"):
        subtask_of_key(b"k", 4, 8)
