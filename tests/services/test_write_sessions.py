"""``WriteSessions`` on the real PostgreSQL: where its batches end changes nothing in the table.

``sessions.batch_rows`` (``conf/clicks.yaml``) sets how many rows ``WriteSessions`` merges per transaction. A user's
session arrives as partial rows (one per bundle on Flink), so a batch boundary can fall between two rows that
merge: the first is stored, the second must then merge with it in a later transaction. This runs the same partial
rows through the transform at several batch sizes and checks each table against one pass over every event.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import apache_beam as beam
import psycopg
import pytest
from psycopg import sql

from beamflow.postgres.sessions import SessionStore
from runners.direct import local_options
from tests.collected import collect, collected
from tests.services.test_session_store import Event, sessions_of
from transforms.write_sessions import WriteSessions

pytestmark = pytest.mark.services


def _events() -> list[Event]:
    """Three users, events a few minutes apart with gaps that end sessions, clicks among impressions."""
    rng = random.Random(7)
    events = []
    for offset in range(240):
        user = f"u{offset % 3}"
        minute = offset // 3 * rng.choice((1.5, 2.0, 2.5, 14.0))
        events.append(Event(user, int(minute * 60_000), rng.choice(("impression", "click")), offset % 2, offset))
    return events


def _partial_rows(events: list[Event]) -> list[dict[str, object]]:
    """Each event's own one-event session row, plus every tenth one again (a replayed bundle), in a shuffled order."""
    rows = [s.to_row() for e in events for s in sessions_of([e])]
    rows += rows[::10]
    random.Random(11).shuffle(rows)
    return rows


@pytest.fixture
def dsn(postgres: object) -> Iterator[str]:
    yield postgres.info["dsn"]  # type: ignore[attr-defined]


def _write(dsn: str, table: str, rows: list[dict[str, object]], batch_rows: int) -> list[dict[str, int]]:
    with beam.Pipeline(options=local_options()) as p:
        result = p | beam.Create(rows, reshuffle=False) | WriteSessions(dsn, table, batch_rows=batch_rows)
        token = collect(result.written, "Reports")
    return collected(token)


@pytest.mark.parametrize("batch_rows", [1, 7, 500])
def test_any_batch_size_leaves_one_pass_over_every_event(dsn: str, batch_rows: int) -> None:
    events = _events()
    rows = _partial_rows(events)
    table = f"sessions_{uuid.uuid4().hex[:8]}"
    try:
        reports = _write(dsn, table, rows, batch_rows)
        store = SessionStore.connect(dsn, table)
        assert [s.stored_row() for s in store.read()] == [s.stored_row() for s in sessions_of(events)]
        # One report per merged batch (every row merged, batch_rows at a time); what they inserted less what they
        # replaced is what the table holds.
        assert len(reports) == -(-len(rows) // batch_rows)
        assert sum(r["rows_written"] - r["rows_replaced"] for r in reports) == len(sessions_of(events))
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in (table, f"{table}_events"):
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))
