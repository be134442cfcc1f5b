"""Upsert throughput of ``PostgresUpsertWriter`` against a bare COPY and against ``executemany`` upserts.

Starts its own PostgreSQL (``beamflow.services.ServiceSet``, data under ``.data/bench``), writes the same rows
with each method, interleaved and repeated, and prints rows/s as ratios against bare COPY into an empty table
measured in the same run (goal: the idempotent upsert at >= 0.5x bare COPY). Stops the server at the end.

.venv/bin/python benchmarks/postgres_upsert.py --rows 200000 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beamflow.postgres import PostgresUpsertWriter, TableSpec
from beamflow.services import ServiceSet
from beamflow.services.paths import project_root

COLUMNS = {
    "id": "uuid",
    "version": "bigint NOT NULL",
    "customer": "text",
    "amount": "numeric(12, 2)",
    "quantity": "int",
    "created": "timestamptz",
    "payload": "text",
}
NAMES = list(COLUMNS)
BATCH = 10_000


def make_rows(n: int) -> list[tuple[Any, ...]]:
    import datetime as dt
    from decimal import Decimal

    t0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    return [
        (
            uuid.UUID(int=i * 2654435761 % (1 << 128)),
            i,
            f"customer-{i % 9973}",
            Decimal(i % 100_000) / 100,
            i % 100,
            t0 + dt.timedelta(seconds=i),
            f"{i:060d}",
        )
        for i in range(n)
    ]


def fresh_table(conn: psycopg.Connection[Any], name: str) -> None:
    conn.execute(f"DROP TABLE IF EXISTS {name}")
    cols = ", ".join(f"{c} {t}" for c, t in COLUMNS.items())
    conn.execute(f"CREATE TABLE {name} ({cols}, PRIMARY KEY (id))")


def bare_copy(dsn: str, rows: list[tuple[Any, ...]], binary: bool) -> float:
    with psycopg.connect(dsn) as conn:
        fresh_table(conn, "bench_copy")
        conn.commit()
        start = time.perf_counter()
        with conn.cursor() as cur:
            fmt = " (FORMAT BINARY)" if binary else ""
            with cur.copy(f"COPY bench_copy ({', '.join(NAMES)}) FROM STDIN{fmt}") as copy:
                if binary:
                    copy.set_types(["uuid", "int8", "text", "numeric", "int4", "timestamptz", "text"])
                for row in rows:
                    copy.write_row(row)
        conn.commit()
        return time.perf_counter() - start


def executemany_upsert(dsn: str, rows: list[tuple[Any, ...]]) -> float:
    with psycopg.connect(dsn) as conn:
        fresh_table(conn, "bench_many")
        conn.commit()
        updates = ", ".join(f"{c} = excluded.{c}" for c in NAMES if c != "id")
        query = (
            f"INSERT INTO bench_many AS t ({', '.join(NAMES)}) VALUES ({', '.join(['%s'] * len(NAMES))}) "
            f"ON CONFLICT (id) DO UPDATE SET {updates} WHERE t.version < excluded.version"
        )
        start = time.perf_counter()
        with conn.cursor() as cur:
            for i in range(0, len(rows), BATCH):
                cur.executemany(query, rows[i : i + BATCH])
                conn.commit()
        return time.perf_counter() - start


def writer_upsert(dsn: str, dict_rows: list[dict[str, Any]], replay: bool) -> float:
    spec = TableSpec("bench_upsert", key=("id",), version=("version",), columns=COLUMNS)
    if not replay:
        with psycopg.connect(dsn) as conn:
            fresh_table(conn, "bench_upsert")
    with PostgresUpsertWriter(spec, dsn=dsn, max_rows=BATCH) as writer:
        writer.columns()
        start = time.perf_counter()
        dead = writer.add_many(dict_rows) + writer.flush()
        elapsed = time.perf_counter() - start
    assert not dead, dead[:3]
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    services = ServiceSet(data=project_root() / ".data" / "bench")
    service = services.get("postgres")
    state = service.up()
    dsn = str(state.info["dsn"])
    try:
        rows = make_rows(args.rows)
        dict_rows = [dict(zip(NAMES, row, strict=True)) for row in rows]
        # The input rows stay alive for the whole run; without freezing them, every variant that allocates per
        # row pays for cyclic-GC passes over millions of input objects, which measures the harness, not the
        # writer (in a pipeline a bundle's rows are few and short-lived).
        gc.collect()
        gc.freeze()
        variants: dict[str, Callable[[], float]] = {
            "bare COPY text, empty table": lambda: bare_copy(dsn, rows, binary=False),
            "bare COPY binary, empty table": lambda: bare_copy(dsn, rows, binary=True),
            "PostgresUpsertWriter, empty table": lambda: writer_upsert(dsn, dict_rows, replay=False),
            "PostgresUpsertWriter, replay into full table": lambda: writer_upsert(dsn, dict_rows, replay=True),
            "executemany INSERT ON CONFLICT": lambda: executemany_upsert(dsn, rows),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, run in variants.items():  # interleaved, so drifts in machine load hit every variant
                times[name].append(run())
        rates = {name: args.rows / statistics.median(ts) for name, ts in times.items()}
        base_text = rates["bare COPY text, empty table"]
        base_binary = rates["bare COPY binary, empty table"]
        print(f"\n{args.rows:,} rows, {BATCH:,} rows per transaction, median of {args.repeats} interleaved runs")
        print(f"{'variant':48} {'rows/s':>10} {'vs COPY text':>13} {'vs COPY binary':>15}")
        for name, rate in rates.items():
            print(f"{name:48} {rate:10,.0f} {rate / base_text:12.2f}x {rate / base_binary:14.2f}x")
        upsert = rates["PostgresUpsertWriter, empty table"]
        print(
            f"\nidempotent upsert / bare COPY: {upsert / base_text:.2f}x (text), {upsert / base_binary:.2f}x "
            f"(binary); goal >= 0.5x. "
            f"Upsert / executemany: {upsert / rates['executemany INSERT ON CONFLICT']:.2f}x"
        )
    finally:
        service.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
