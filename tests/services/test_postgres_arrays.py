"""The array literals of ``beamflow.postgres.arrays`` reach the real server as the very arrays psycopg's own dumper
sends: every awkward string (quotes, backslashes, braces, commas, blanks, the word NULL, the empty string, non-ASCII),
NULLs, the int extremes, datetimes to the microsecond in any offset, booleans."""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest

from beamflow.postgres.arrays import array_literal, bool_array, int_array, text_array, timestamptz_array
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
TIMES = [
    dt.datetime(2026, 12, 5, 5, 0, 0, 123456, tzinfo=dt.UTC),
    dt.datetime(2026, 12, 5, 5, 0, 0, tzinfo=dt.UTC),  # no microseconds: str() leaves the fraction out
    dt.datetime(2026, 12, 5, 10, 30, 0, 1, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
    dt.datetime(1970, 1, 1, tzinfo=dt.UTC),
    None,
]
BOOLS = [True, False, None]


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


def test_time_and_boolean_literals_are_the_arrays_psycopg_sends(postgres: ServiceState) -> None:
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as conn:
        conn.execute("SET TIME ZONE 'America/New_York'")  # the literals carry their offset; the session's zone is moot
        ours = conn.execute("SELECT %s::timestamptz[], %s::boolean[]", (timestamptz_array(TIMES), bool_array(BOOLS)))
        psycopgs = conn.execute("SELECT %s::timestamptz[], %s::boolean[]", (TIMES, BOOLS))
        assert ours.fetchone() == psycopgs.fetchone() == (TIMES, BOOLS)
        by_type = conn.execute(
            "SELECT %s::timestamptz[], %s::text[], %s::bigint[]",
            (array_literal(TIMES, "timestamptz"), array_literal(AWKWARD, "text"), array_literal(INTS, "bigint")),
        ).fetchone()
        assert by_type == (TIMES, AWKWARD, INTS)


def test_a_naive_datetime_or_an_unknown_type_is_refused() -> None:
    with pytest.raises(TypeError, match="aware datetimes"):
        timestamptz_array([dt.datetime(2026, 12, 5)])
    with pytest.raises(TypeError, match="bool_array takes bools"):
        bool_array([1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="no array literal for 'jsonb'"):
        array_literal([{}], "jsonb")


def test_a_value_that_is_not_an_int_is_refused_not_coerced() -> None:
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="int_array takes ints"):
            int_array([1, bad])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="text_array takes strs"):
        text_array(["a", 1])  # type: ignore[list-item]
