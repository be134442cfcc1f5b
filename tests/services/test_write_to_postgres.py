"""The Beam transforms on the pinned local runner against a real PostgreSQL: upserts, dead letters, replay."""

from __future__ import annotations

import json
import uuid
from typing import Any

import apache_beam as beam
import psycopg
import pytest
from apache_beam.testing.util import assert_that, equal_to

from beamflow.deadletter import DeadLetter
from beamflow.postgres import TableSpec
from beamflow.postgres.cells import Cell, PostgresCellStore, RowKeySalter
from beamflow.services import ServiceState
from runners.direct import local_options
from transforms.write_to_postgres import WriteToPostgres
from transforms.write_versioned_cells import WriteVersionedCells

pytestmark = pytest.mark.services


def _dead_summary(dead: DeadLetter) -> tuple[Any, str | None, bool]:
    return (json.loads(dead.payload)["id"], dead.error, bool(dead.reason))


def _run_upserts(dsn: str, spec: TableSpec, rows: list[dict[str, Any]], expected_dead: list[Any], replay: bool) -> None:
    with beam.Pipeline(options=local_options()) as pipeline:
        result = pipeline | beam.Create(rows) | WriteToPostgres(dsn, spec, create=True, max_rows=7)
        assert_that(result.dead_letters | beam.Map(_dead_summary), equal_to(expected_dead))
        # The written reports count rows the database changed: every id at least once, and nothing on a replay.
        written = result.written | beam.Map(lambda report: report["rows_written"]) | beam.CombineGlobally(sum)
        assert_that(written | beam.Map(lambda n: n == 0 if replay else n >= 40), equal_to([True]), label="written")


def test_write_to_postgres_upserts_and_emits_dead_letters(postgres: ServiceState) -> None:
    dsn = postgres.info["dsn"]
    table = f"beam_orders_{uuid.uuid4().hex[:8]}"
    spec = TableSpec(
        table,
        key=("id",),
        version=("version",),
        columns={"id": "bigint", "version": "bigint NOT NULL", "status": "text NOT NULL", "qty": "int"},
    )
    rows: list[dict[str, Any]] = [
        {"id": i, "version": v, "status": f"s{v}", "qty": i} for i in range(40) for v in (2, 1, 3)
    ]
    rows.append({"id": 100, "version": 1, "status": None, "qty": 1})
    rows.append({"id": 101, "version": 1, "status": "ok", "qty": "many"})
    expected_dead = [(100, "23502", True), (101, "22P02", True)]
    _run_upserts(dsn, spec, rows, expected_dead, replay=False)
    # Replaying the whole input (as a runner does after a failure) leaves the same table.
    _run_upserts(dsn, spec, list(reversed(rows)), expected_dead, replay=True)
    with psycopg.connect(dsn) as conn:
        got = conn.execute(f"SELECT id, version, status FROM {table} ORDER BY id").fetchall()
    assert got == [(i, 3, "s3") for i in range(40)]


def test_write_versioned_cells_newest_wins(postgres: ServiceState) -> None:
    dsn = postgres.info["dsn"]
    table = f"beam_cells_{uuid.uuid4().hex[:8]}"
    cells = [Cell(f"device-{d}".encode(), "m:temp", ts, str(ts).encode()) for d in range(20) for ts in (3, 1, 2)]
    elements: list[Any] = [*cells, "not a cell"]
    for run in range(2):  # a replay changes nothing
        with beam.Pipeline(options=local_options()) as pipeline:
            result = pipeline | beam.Create(elements) | WriteVersionedCells(dsn, table, salt_buckets=4, max_cells=9)
            assert_that(result.dead_letters | beam.Map(lambda d: d.error), equal_to(["TypeError"]))
            stored = result.written | beam.Map(lambda report: report["rows_written"]) | beam.CombineGlobally(sum)
            assert_that(stored, equal_to([len(cells) if run == 0 else 0]), label="versions stored")
    store = PostgresCellStore(table, dsn=dsn)
    try:
        salter = RowKeySalter(4)
        for d in range(20):
            newest = store.get(salter.salt(f"device-{d}".encode()), "m:temp")
            assert newest is not None and (newest.timestamp, newest.value) == (3, b"3")
        assert len(list(store.scan())) == 20
    finally:
        store.close()
