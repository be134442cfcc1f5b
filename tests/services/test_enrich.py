"""``Enrich`` against a real PostgreSQL: batched lookups, bounded concurrency, timestamps and windows kept, the
missing-key policies, the cell store as a source, a server restart mid-run and an unreachable store."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import apache_beam as beam
import psycopg
import pytest
from apache_beam.transforms.window import FixedWindows, IntervalWindow, TimestampedValue

from beamflow.enrichment import BatchedLookups, LookupCache, LookupRetry, StoreUnavailable
from beamflow.postgres.cells import Cell, PostgresCellStore
from beamflow.postgres.lookups import CellStoreLookup, PostgresTableLookup
from beamflow.services import ServiceSet, ServiceState
from beamflow.services.base import free_port
from runners.direct import local_options
from tests.collected import collect, collected
from transforms.enrich import Enrich

pytestmark = pytest.mark.services

DRIVERS = 300


@pytest.fixture
def drivers(postgres: ServiceState) -> Iterator[str]:
    """A dimension table of DRIVERS drivers (d0000..), keys d9xxx unknown."""
    table = f"drivers_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (driver_id text PRIMARY KEY, name text NOT NULL, rating real)")
        with conn.cursor().copy(f"COPY {table} (driver_id, name, rating) FROM STDIN") as copy:
            for i in range(DRIVERS):
                copy.write_row((f"d{i:04d}", f"driver {i}", 4.0 + (i % 10) / 10))
    yield table
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


class ConcurrencySpy:
    """A real handler wrapped to record how many batches run at once and how big each is."""

    def __init__(self, inner: PostgresTableLookup) -> None:
        self.inner = inner
        self.columns = inner.columns
        self.running = 0
        self.most = 0
        self.sizes: list[int] = []
        self._lock = threading.Lock()

    def __enter__(self) -> ConcurrencySpy:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)

    def is_transient(self, exc: BaseException) -> bool:
        return self.inner.is_transient(exc)

    def cache_key(self, key: Hashable) -> Hashable:
        return key

    def lookup(self, keys: Sequence[Hashable]) -> dict[Hashable, Mapping[str, Any]]:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.sizes.append(len(keys))
        try:
            time.sleep(0.02)  # long enough for batches to overlap
            return self.inner.lookup(keys)
        finally:
            with self._lock:
                self.running -= 1


def test_one_statement_per_batch_of_distinct_keys_and_a_bound_on_batches_in_flight(
    postgres: ServiceState, drivers: str
) -> None:
    spy = ConcurrencySpy(PostgresTableLookup(postgres.info["dsn"], drivers, "driver_id", ("name", "rating")))
    with spy:
        lookups: BatchedLookups[int] = BatchedLookups(spy, max_batch_size=40, max_in_flight=3)
        ready = []
        for i in range(2000):  # 2000 items over 350 distinct keys (50 unknown), each key three times in a row
            ready += lookups.add(i, f"d{i // 3 % 350:04d}")
        assert lookups.in_flight <= 3
        ready += lookups.drain()
        lookups.close()
    assert lookups.in_flight == 0
    assert sorted(i for i, _ in ready) == list(range(2000))
    for i, row in ready:
        key = i // 3 % 350
        assert (row is None) == (key >= DRIVERS)
        if row is not None:
            assert row["name"] == f"driver {key}"
    assert max(spy.sizes) <= 40 and len(spy.sizes) == lookups.stats.batches
    assert sum(spy.sizes) < 700  # a key repeated within a batch is looked up once
    assert 1 < spy.most <= 3


def test_cache_answers_repeated_keys_without_a_statement(postgres: ServiceState, drivers: str) -> None:
    handler = PostgresTableLookup(postgres.info["dsn"], drivers, "driver_id", ("name",))
    with handler:
        lookups: BatchedLookups[int] = BatchedLookups(handler, max_batch_size=50, cache=LookupCache(1000, 60))
        first = lookups.add(0, "d0001") + lookups.drain()
        batches = lookups.stats.batches
        again = lookups.add(1, "d0001") + lookups.add(2, "d9999") + lookups.drain()
        third = lookups.add(3, "d9999") + lookups.drain()
        lookups.close()
    assert first == [(0, {"name": "driver 1"})]
    assert (1, {"name": "driver 1"}) in again and (2, None) in again
    assert third == [(3, None)]  # the miss is cached too
    assert lookups.stats.batches == batches + 1  # only d9999's first lookup went to the table
    assert lookups.stats.cache_hits == 2


def _rides(n: int, unknown_every: int = 0) -> list[TimestampedValue]:
    rides = []
    for i in range(n):
        driver = f"d9{i:03d}" if unknown_every and i % unknown_every == 0 else f"d{i % DRIVERS:04d}"
        rides.append(TimestampedValue({"ride_id": i, "driver_id": driver}, 1_700_000_000 + i))
    return rides


def _run(rides: list[TimestampedValue], enrich: Enrich, hook: Any = None) -> tuple[list[Any], list[Any], Any]:
    p = beam.Pipeline(options=local_options())
    pcoll = p | beam.Create(rides) | "Window" >> beam.WindowInto(FixedWindows(60))
    if hook is not None:
        pcoll = pcoll | "Hook" >> beam.Map(hook)
    result = pcoll | enrich
    enriched = collect(result.enriched, "enriched", with_time=True)
    dead = collect(result.dead_letters, "dead")
    run = p.run()
    run.wait_until_finish()
    return collected(enriched), collected(dead), run


def test_elements_keep_timestamps_and_windows_and_unknown_keys_pass_with_nulls(
    postgres: ServiceState, drivers: str
) -> None:
    handler = PostgresTableLookup(postgres.info["dsn"], drivers, "driver_id", ("name", "rating"))
    enriched, dead, _ = _run(_rides(1000, unknown_every=10), Enrich(handler, key_field="driver_id", max_batch_size=64))
    assert dead == []
    assert len(enriched) == 1000
    for element, timestamp, window in enriched:
        i = element["ride_id"]
        assert timestamp.micros == (1_700_000_000 + i) * 1_000_000
        start = (1_700_000_000 + i) // 60 * 60
        assert window == IntervalWindow(start, start + 60)
        if i % 10 == 0:
            assert element["name"] is None and element["rating"] is None
        else:
            assert element["name"] == f"driver {i % DRIVERS}"


def test_unknown_keys_become_dead_letters_under_that_policy(postgres: ServiceState, drivers: str) -> None:
    handler = PostgresTableLookup(postgres.info["dsn"], drivers, "driver_id", ("name",))
    rides = [*_rides(500, unknown_every=7), TimestampedValue({"ride_id": -1}, 1_700_000_000)]
    enriched, dead, _ = _run(rides, Enrich(handler, key_field="driver_id", on_missing="dead_letter"))
    unknown = {i for i in range(500) if i % 7 == 0}
    assert sorted(e["ride_id"] for e, _, _ in enriched) == [i for i in range(500) if i not in unknown]
    reasons = sorted(d.reason for d in dead)
    assert len(dead) == len(unknown) + 1
    assert sum("no lookup key" in r for r in reasons) == 1  # the ride without a driver_id
    assert sum(r.startswith(f"no {drivers} row for key 'd9") for r in reasons) == len(unknown)


def test_cell_store_is_a_lookup_source(postgres: ServiceState) -> None:
    store = PostgresCellStore(f"cells_{uuid.uuid4().hex[:8]}", dsn=postgres.info["dsn"])
    from beamflow.postgres.cells import RowKeySalter

    salter = RowKeySalter(8)
    cells = [
        Cell(salter.salt(f"z{z}".encode()), column, ts, f"{column}@{ts}".encode())
        for z in range(20)
        for column in ("zone:name", "zone:borough")
        for ts in (1, 2)
    ]
    assert store.mutate(cells) == []
    handler = CellStoreLookup(
        postgres.info["dsn"],
        store.spec.table,
        ["zone:name", "zone:borough"],
        salt_buckets=8,
        alias={"zone:name": "zone"},
    )
    with handler:
        rows = handler.lookup(["z1", "z19", "nope"])
    store.close()
    assert rows == {
        "z1": {"zone": "zone:name@2", "borough": "zone:borough@2"},
        "z19": {"zone": "zone:name@2", "borough": "zone:borough@2"},
    }


# A restart of the PostgreSQL server, started from inside the pipeline when element RESTART_AT passes, so it falls
# mid-run whatever the machine's speed.
_RESTART: dict[str, Any] = {}
RESTART_AT = 300


def _up_after(service: Any, seconds: float) -> None:
    time.sleep(seconds)
    service.up()


def _restart_postgres_at(element: dict[str, Any]) -> dict[str, Any]:
    if element["ride_id"] == RESTART_AT and "done" not in _RESTART:
        _RESTART["done"] = True
        service = _RESTART["service"]
        service.down()  # synchronous: every lookup from here on fails until the server is back
        threading.Thread(target=_up_after, args=(service, 2.0), daemon=True).start()
    return element


def test_store_restarted_mid_run_loses_and_dead_letters_nothing(
    postgres: ServiceState, drivers: str, service_set: ServiceSet
) -> None:
    _RESTART.clear()
    _RESTART["service"] = service_set.get("postgres")
    # A 1 s deadline (connection wait included) against a server down for more than 2 s: lookups do fail meanwhile.
    handler = PostgresTableLookup(postgres.info["dsn"], drivers, "driver_id", ("name",), timeout_s=1)
    started_before = _postmaster_started(postgres.info["dsn"])
    enrich = Enrich(handler, key_field="driver_id", on_missing="dead_letter", max_batch_size=20, cache_size=0)
    enriched, dead, run = _run(_rides(1500), enrich, hook=_restart_postgres_at)
    assert _RESTART.get("done")
    assert dead == []
    assert sorted(e["ride_id"] for e, _, _ in enriched) == list(range(1500))
    assert all(e["name"] == f"driver {e['ride_id'] % DRIVERS}" for e, _, _ in enriched)
    retries = run.metrics().query(beam.metrics.MetricsFilter().with_name("retries"))["counters"]
    assert sum(c.committed for c in retries) > 0  # the restart was really hit, and ridden out
    assert _postmaster_started(postgres.info["dsn"]) > started_before


def _postmaster_started(dsn: str) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
        assert row is not None
        return row[0]


def test_unreachable_store_fails_the_bundle_instead_of_dead_lettering() -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/beamflow"  # nothing listens there
    handler = PostgresTableLookup(dsn, "drivers", "driver_id", ("name",), timeout_s=1)
    retry = LookupRetry(max_elapsed_s=3, base_delay_s=0.05, max_delay_s=0.5)
    with pytest.raises(Exception, match="lookup store unavailable"):
        _run(_rides(50), Enrich(handler, key_field="driver_id", on_missing="dead_letter", retry=retry))


def test_unreachable_store_raises_store_unavailable_from_the_engine() -> None:
    handler = PostgresTableLookup(f"postgresql://postgres@127.0.0.1:{free_port()}/x", "t", "k", ("v",), timeout_s=1)
    with handler:
        lookups: BatchedLookups[int] = BatchedLookups(handler, retry=LookupRetry(max_elapsed_s=2))
        lookups.add(1, "a")
        with pytest.raises(StoreUnavailable):
            lookups.drain()
        lookups.close()
