"""The array literals of ``beamflow.postgres.arrays`` reach the real server as the very arrays psycopg's own dumper
sends: every awkward string (quotes, backslashes, braces, commas, blanks, the word NULL, the empty string, non-ASCII),
NULLs, the int extremes."""

from __future__ import annotations

import psycopg
import pytest

from beamflow.postgres.arrays import int_array, text_array
from beamflow.services import ServiceState

pytestmark = pytest.mark.services

AWKWARD = [
    "plain",
    "",
    "NULL",
    "null",
    " leading and trailing ",
    'a "quoted" word',
    "back\\slash",
    "\\",
    '\\"',
    "{braces}",
    "a,comma",
    "tab\tand\nnewline",
    "ünïcödé ✓ 雪",
    None,
]
INTS = [0, 1, -1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 1_796_434_945_946]


def test_the_literals_are_the_arrays_psycopg_sends(postgres: ServiceState) -> None:
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as conn:
        ours = conn.execute("SELECT %s::text[], %s::bigint[]", (text_array(AWKWARD), int_array(INTS))).fetchone()
        psycopgs = conn.execute("SELECT %s::text[], %s::bigint[]", (AWKWARD, INTS)).fetchone()
        assert ours == psycopgs == (AWKWARD, INTS)
        # unnest keeps order and row count, as the stores' INSERT ... SELECT FROM unnest(...) need.
        rows = conn.execute(
            "SELECT * FROM unnest(%s::text[], %s::bigint[])", (text_array(AWKWARD[:8]), int_array(INTS))
        ).fetchall()
        assert rows == list(zip(AWKWARD[:8], INTS, strict=True))
        assert conn.execute("SELECT %s::text[], %s::bigint[]", (text_array([]), int_array([]))).fetchone() == ([], [])


def test_a_value_that_is_not_an_int_is_refused_not_coerced() -> None:
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="int_array takes ints"):
            int_array([1, bad])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="text_array takes strs"):
        text_array(["a", 1])  # type: ignore[list-item]
