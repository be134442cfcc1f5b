"""The upsert engine against a real PostgreSQL: idempotent replays, newest version wins, crash and restart
recovery, dead letters with the database's message, and names that can never inject SQL."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from beamflow.postgres import PostgresUpsertWriter, RetryPolicy, TableSpec
from beamflow.services import ServiceSet, ServiceState

pytestmark = pytest.mark.services

EVENT_COLUMNS = {
    "event_id": "bigint",
    "event_time": "timestamptz NOT NULL",
    "kafka_offset": "bigint NOT NULL",
    "customer": "text NOT NULL",
    "amount": "numeric(12, 2)",
    "quantity": "int",
    "attrs": "jsonb",
}
T0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def _name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def _spec(table: str, **overrides: Any) -> TableSpec:
    values: dict[str, Any] = {
        "table": table,
        "key": ("event_id",),
        "version": ("event_time", "kafka_offset"),
        "columns": EVENT_COLUMNS,
    }
    values.update(overrides)
    return TableSpec(**values)


def _event(i: int, version: int = 0) -> dict[str, Any]:
    return {
        "event_id": i,
        "event_time": T0 + dt.timedelta(seconds=i % 3600 + version),
        "kafka_offset": i * 10 + version,
        "customer": f"customer-{i % 977}",
        "amount": (i * 37 % 100_000) / 100,
        "quantity": i % 50 + version,
        "attrs": {"v": version, "tag": f"t{i % 7}"},
    }


@pytest.fixture
def conn(postgres: ServiceState) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as connection:
        yield connection


def _count(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def _difference(conn: psycopg.Connection[Any], a: str, b: str) -> int:
    row = conn.execute(
        f"SELECT (SELECT count(*) FROM (TABLE {a} EXCEPT ALL TABLE {b}) x)"
        f" + (SELECT count(*) FROM (TABLE {b} EXCEPT ALL TABLE {a}) y)"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_same_events_three_times_shuffled_equal_one_clean_run(postgres: ServiceState, conn: Any) -> None:
    dsn = postgres.info["dsn"]
    events = [_event(i) for i in range(100_000)]
    clean, replayed = _name("clean"), _name("replayed")
    with PostgresUpsertWriter(_spec(clean), dsn=dsn, create=True, max_rows=10_000) as writer:
        assert writer.add_many(events) + writer.flush() == []
    rng = random.Random(7)
    with PostgresUpsertWriter(_spec(replayed), dsn=dsn, create=True) as writer:
        for batch_rows in (7_000, 25_000, 3_333):
            writer.max_rows = batch_rows
            shuffled = events[:]
            rng.shuffle(shuffled)
            assert writer.add_many(shuffled) + writer.flush() == []
        assert writer.stats.rows_in == 300_000
        assert writer.stats.dead_letters == 0
    assert _count(conn, clean) == 100_000
    assert _count(conn, replayed) == 100_000
    assert _difference(conn, clean, replayed) == 0


def test_out_of_order_versions_newest_wins(postgres: ServiceState, conn: Any) -> None:
    table = _name("versions")
    deliveries = [_event(i, version) for i in range(500) for version in range(5)]
    # Same event time for two versions: the Kafka offset breaks the tie (composite version compared as a row).
    tie = dict(_event(9_999, 3), kafka_offset=5)
    tie_newer = dict(_event(9_999, 3), kafka_offset=6, customer="tie-winner")
    deliveries += [tie_newer, tie]
    random.Random(3).shuffle(deliveries)
    with PostgresUpsertWriter(_spec(table), dsn=postgres.info["dsn"], create=True, max_rows=333) as writer:
        assert writer.add_many(deliveries) + writer.flush() == []
        # Replaying an older version after the newest changes nothing.
        assert writer.write_batch([_event(1, 0), _event(2, 1)]) == []
    rows = conn.execute(f"SELECT event_id, kafka_offset, quantity, attrs FROM {table} ORDER BY event_id").fetchall()
    assert len(rows) == 501
    for event_id, offset, quantity, attrs in rows[:-1]:
        newest = _event(event_id, 4)
        assert (offset, quantity, attrs) == (newest["kafka_offset"], newest["quantity"], newest["attrs"])
    assert conn.execute(f"SELECT customer FROM {table} WHERE event_id = 9999").fetchone() == ("tie-winner",)


def test_immutable_events_first_write_wins(postgres: ServiceState, conn: Any) -> None:
    table = _name("immutable")
    spec = TableSpec(table, key=("event_id",), columns={"event_id": "bigint", "customer": "text"})
    with PostgresUpsertWriter(spec, dsn=postgres.info["dsn"], create=True) as writer:
        writer.write_batch([{"event_id": 1, "customer": "a"}])
        writer.write_batch([{"event_id": 1, "customer": "b"}, {"event_id": 2, "customer": "c"}])
    assert conn.execute(f"SELECT * FROM {table} ORDER BY event_id").fetchall() == [(1, "a"), (2, "c")]


_KILL_CHILD = """
import sys
sys.path.insert(0, sys.argv[3])
from beamflow.postgres import PostgresUpsertWriter
from tests.services.test_postgres_writer import _event, _spec
writer = PostgresUpsertWriter(_spec(sys.argv[2]), dsn=sys.argv[1], max_rows=2_000)
writer.add_many(_event(i) for i in range(int(sys.argv[4])))
writer.flush()
print("finished", flush=True)
"""


def _slow_down_inserts(conn: Any, table: str, seconds: float) -> None:
    """A statement trigger that sleeps, so a batch's transaction stays open long enough to be interrupted."""
    conn.execute(
        f"CREATE FUNCTION {table}_pause() RETURNS trigger LANGUAGE plpgsql AS "
        f"$$ BEGIN PERFORM pg_sleep({seconds}); RETURN NULL; END $$"
    )
    conn.execute(
        f"CREATE TRIGGER {table}_pause AFTER INSERT OR UPDATE ON {table} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {table}_pause()"
    )


def _wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_writer_killed_mid_batch_then_rerun_every_row_once(postgres: ServiceState, conn: Any) -> None:
    table, total = _name("killed"), 40_000
    dsn = postgres.info["dsn"]
    with PostgresUpsertWriter(_spec(table), dsn=dsn, create=True) as writer:
        writer.columns()  # creates the table
    _slow_down_inserts(conn, table, 0.5)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen(
        [sys.executable, "-c", _KILL_CHILD, dsn, table, root, str(total)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        # Wait until some batches committed AND the child is inside a batch's INSERT (its transaction open).
        def mid_batch() -> bool:
            active = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'INSERT INTO%%' AND state = 'active' "
                "AND pid <> pg_backend_pid()"
            ).fetchone()
            return _count(conn, table) > 0 and active is not None and active[0] > 0

        _wait_for(mid_batch, 60, "the writer to be mid-batch")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL

    # The interrupted transaction is rolled back once its backend notices the client is gone.
    def backend_gone() -> bool:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'INSERT INTO%%' AND pid <> pg_backend_pid()"
        ).fetchone()
        return row is not None and row[0] == 0

    _wait_for(backend_gone, 30, "the killed writer's backend to end")
    partial = _count(conn, table)
    assert 0 < partial < total
    assert partial % 2_000 == 0, "a batch is all or nothing"
    conn.execute(f"DROP TRIGGER {table}_pause ON {table}")
    with PostgresUpsertWriter(_spec(table), dsn=dsn, max_rows=5_000) as writer:
        assert writer.add_many(_event(i) for i in range(total)) + writer.flush() == []
    assert _count(conn, table) == total
    row = conn.execute(f"SELECT count(DISTINCT event_id), sum(kafka_offset) FROM {table}").fetchone()
    assert row == (total, sum(i * 10 for i in range(total)))


def test_postgres_restarted_while_writing_retries_and_finishes(
    postgres: ServiceState, service_set: ServiceSet, conn: Any
) -> None:
    table, total = _name("restarted"), 20_000
    dsn = postgres.info["dsn"]
    with PostgresUpsertWriter(_spec(table), dsn=dsn, create=True) as writer:
        writer.columns()
    _slow_down_inserts(conn, table, 0.2)
    conn.close()
    outcome: dict[str, Any] = {}
    policy = RetryPolicy(max_attempts=30, base_delay=0.05, max_delay=2.0, max_elapsed=90)

    def write() -> None:
        try:
            with PostgresUpsertWriter(_spec(table), dsn=dsn, max_rows=1_000, retry=policy) as writer:
                outcome["dead"] = writer.add_many(_event(i) for i in range(total)) + writer.flush()
                outcome["stats"] = writer.stats
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=write)
    thread.start()

    def some_committed() -> bool:
        with psycopg.connect(dsn) as c:
            return _count(c, table) > 0

    _wait_for(some_committed, 60, "the first committed batch")
    restarted = service_set.get("postgres").restart()  # type: ignore[attr-defined]
    postgres.pids[:] = restarted.pids
    thread.join(timeout=180)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["dead"] == []
    assert outcome["stats"].retries >= 1, "the restart should have interrupted the writer at least once"
    with psycopg.connect(dsn) as c:
        assert _count(c, table) == total
        assert c.execute(f"SELECT count(DISTINCT event_id) FROM {table}").fetchone() == (total,)


def test_bad_rows_become_dead_letters_with_database_message(postgres: ServiceState, conn: Any) -> None:
    table = _name("bad_rows")
    # The CHECK is added by hand below: declared column types never carry expressions.
    spec = _spec(table, columns=dict(EVENT_COLUMNS))
    rows = [_event(i) for i in range(1_000)]
    rows[10]["customer"] = None  # NOT NULL
    rows[250]["quantity"] = "lots"  # type
    rows[500]["amount"] = 10**12  # numeric overflow
    rows[750]["quantity"] = 2**40  # int range (binary COPY would silently truncate this)
    rows[900]["quantity"] = -5  # CHECK
    rows[950]["attrs"] = "{not json"  # invalid json text
    with PostgresUpsertWriter(spec, dsn=postgres.info["dsn"], create=True, max_rows=400) as writer:
        writer.columns()
        conn.execute(f"ALTER TABLE {table} ADD CONSTRAINT quantity_positive CHECK (quantity >= 0)")
        dead = writer.add_many(rows) + writer.flush()
    by_id = {json.loads(d.payload)["event_id"]: d for d in dead}
    assert sorted(by_id) == [10, 250, 500, 750, 900, 950]
    assert by_id[10].error == "23502" and "not-null constraint" in by_id[10].reason
    assert f'relation "{table}"' in by_id[10].reason
    assert by_id[250].error == "22P02" and 'invalid input syntax for type integer: "lots"' in by_id[250].reason
    assert by_id[500].error == "22003" and "numeric field overflow" in by_id[500].reason
    assert by_id[750].error == "22003" and "out of range for type integer" in by_id[750].reason
    assert by_id[900].error == "23514" and "quantity_positive" in by_id[900].reason
    assert by_id[950].error == "22P02" and "json" in by_id[950].reason
    assert all(d.stage == f"postgres:{table}" for d in dead)
    assert _count(conn, table) == 994
    ids = {r[0] for r in conn.execute(f"SELECT event_id FROM {table}").fetchall()}
    assert ids == set(range(1_000)) - set(by_id)


def test_unknown_fields_are_dead_letters_not_dropped(postgres: ServiceState, conn: Any) -> None:
    table = _name("unknown")
    spec = TableSpec(table, key=("id",), columns={"id": "bigint", "v": "text"})
    with PostgresUpsertWriter(spec, dsn=postgres.info["dsn"], create=True) as writer:
        dead = writer.write_batch([{"id": 1, "v": "a"}, {"id": 2, "v": "b", "surprise": 1}])
    assert [d.error for d in dead] == ["UnknownColumn"]
    assert "surprise" in dead[0].reason
    assert _count(conn, table) == 1


@pytest.mark.parametrize(
    "bad_name",
    ['x"; DROP TABLE {victim}; --', "{victim}; DROP TABLE {victim}", "a b", "a'b", "", "x" * 64, "a-b", "--"],
)
def test_injection_names_are_rejected_and_never_executed(postgres: ServiceState, conn: Any, bad_name: str) -> None:
    victim = _name("victim")
    conn.execute(f"CREATE TABLE {victim} (id int)")
    name = bad_name.format(victim=victim)
    with pytest.raises(ValueError, match="invalid"):
        TableSpec(name, key=("id",), columns={"id": "bigint"})
    with pytest.raises(ValueError, match="invalid"):
        TableSpec(victim, key=(name,), columns={name: "bigint"})
    with pytest.raises(ValueError, match="invalid"):
        TableSpec(victim, key=("id",), schema=name)
    with pytest.raises(ValueError, match="invalid SQL type"):
        TableSpec(_name("t"), key=("id",), columns={"id": f"bigint); DROP TABLE {victim}; --"})
    assert conn.execute("SELECT to_regclass(%s) IS NOT NULL", (victim,)).fetchone() == (True,)


def test_keyword_names_are_quoted(postgres: ServiceState, conn: Any) -> None:
    schema = _name("select")
    spec = TableSpec(
        "table",
        schema=schema,
        key=("order",),
        version=("from",),
        columns={"order": "bigint", "from": "bigint NOT NULL", "user": "text", "where": "double precision"},
    )
    with PostgresUpsertWriter(spec, dsn=postgres.info["dsn"], create=True) as writer:
        rows = [{"order": 1, "from": 2, "user": "new", "where": 1.5}, {"order": 1, "from": 1, "user": "old"}]
        assert writer.write_batch(rows) == []
    got = conn.execute(f'SELECT "order", "from", "user", "where" FROM "{schema}"."table"').fetchall()
    assert got == [(1, 2, "new", 1.5)]


def test_binary_and_text_copy_store_the_same_values(postgres: ServiceState, conn: Any) -> None:
    rows = [dict(_event(i), attrs='{"k": [1, 2]}', amount=12.34) for i in range(5)]
    rows.append(dict(_event(5), attrs={"already": "parsed"}, amount=0.1))
    tables = []
    for binary in (True, False):
        table = _name("binary" if binary else "text")
        with PostgresUpsertWriter(_spec(table), dsn=postgres.info["dsn"], create=True, binary=binary) as writer:
            assert writer.write_batch(rows) == []
            assert writer.stats.text_fallbacks == 0
        tables.append(table)
    assert _difference(conn, *tables) == 0
    got = conn.execute(f"SELECT attrs, amount::text FROM {tables[0]} WHERE event_id IN (0, 5) ORDER BY 1").fetchall()
    assert sorted(map(str, got)) == sorted(map(str, [({"k": [1, 2]}, "12.34"), ({"already": "parsed"}, "0.10")]))


def test_batches_flush_by_rows_bytes_and_age(postgres: ServiceState, conn: Any) -> None:
    table = _name("thresholds")
    spec = TableSpec(table, key=("id",), columns={"id": "bigint", "blob": "text"})
    with PostgresUpsertWriter(spec, dsn=postgres.info["dsn"], create=True, max_rows=3) as writer:
        writer.add_many({"id": i, "blob": "x"} for i in range(7))
        assert (_count(conn, table), writer.buffered) == (6, 1)
        writer.flush()
    with PostgresUpsertWriter(spec, dsn=postgres.info["dsn"], max_bytes=50_000) as writer:
        writer.add_many({"id": 100 + i, "blob": "y" * 1_000} for i in range(64))
        assert writer.stats.batches >= 1 and writer.buffered < 64  # crossed 50 kB before 64 rows
        writer.flush()
    with PostgresUpsertWriter(spec, dsn=postgres.info["dsn"], max_seconds=0.2) as writer:
        writer.add({"id": 1_000, "blob": "z"})
        assert writer.buffered == 1
        time.sleep(0.3)
        writer.add({"id": 1_001, "blob": "z"})
        assert writer.buffered == 0
    assert _count(conn, table) == 7 + 64 + 2


def _created_by_eight_at_once(create: Callable[[str], None]) -> list[BaseException]:
    """Eight connections create the same new table at the same moment (a barrier), five tables in a row."""
    errors: list[BaseException] = []
    for _ in range(5):
        table = f"race_{uuid.uuid4().hex[:8]}"
        start = threading.Barrier(8)

        def run(table: str = table, start: threading.Barrier = start) -> None:
            try:
                start.wait()
                create(table)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return errors


def test_parallel_writers_create_the_same_table_without_a_race(postgres: ServiceState) -> None:
    import psycopg

    from beamflow.postgres.table import TableSpec, create_table

    def create(table: str) -> None:
        with psycopg.connect(postgres.info["dsn"]) as conn:
            create_table(conn, TableSpec(table, key=("k",), columns={"k": "text", "v": "bigint"}))

    assert _created_by_eight_at_once(create) == []


def test_parallel_subtasks_create_the_first_copies_table_without_a_race(postgres: ServiceState) -> None:
    """Both subtasks of a parallelism-2 Flink job create the dedup's first-copies table in ``setup``: without the
    creation lock one of them failed on pg_type's unique index and the job restarted."""
    from beamflow.postgres.first_copies import FirstCopyStore
    from beamflow.postgres.writer import open_pool

    def create(table: str) -> None:
        pool = open_pool(postgres.info["dsn"], max_size=1)  # one store and pool per thread, like one per worker
        try:
            FirstCopyStore(pool, table, ttl_ms=60_000).create()
        finally:
            pool.close()

    assert _created_by_eight_at_once(create) == []
