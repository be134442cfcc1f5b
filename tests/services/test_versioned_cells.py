"""HBase-style versioned cells on a real PostgreSQL: newest version wins, replays are no-ops, salted keys
spread."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from beamflow.postgres.cells import BufferedMutator, Cell, PostgresCellStore, RowKeySalter, split_column
from beamflow.services import ServiceState

pytestmark = pytest.mark.services


@pytest.fixture
def store(postgres: ServiceState) -> Iterator[PostgresCellStore]:
    cell_store = PostgresCellStore(f"cells_{uuid.uuid4().hex[:8]}", dsn=postgres.info["dsn"])
    yield cell_store
    cell_store.close()


def _rows_in(store: PostgresCellStore, dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {store.spec.table}").fetchone()
        assert row is not None
        return int(row[0])


def test_newest_version_wins_whatever_the_delivery_order(store: PostgresCellStore, postgres: ServiceState) -> None:
    cells = [
        Cell(f"user-{u}".encode(), column, ts, f"{column}@{ts}".encode())
        for u in range(50)
        for column in ("profile:email", "profile:name", "stats:clicks")
        for ts in (100, 200, 300)
    ]
    random.Random(1).shuffle(cells)
    assert store.mutate(cells) == []
    for u in (0, 17, 49):
        newest = store.get(f"user-{u}".encode(), "profile:email")
        assert newest == Cell(f"user-{u}".encode(), "profile:email", 300, b"profile:email@300")
    assert [c.timestamp for c in store.versions(b"user-3", "stats:clicks")] == [300, 200, 100]
    assert store.get(b"user-3", "profile:missing") is None
    # Replaying everything (and an old version again) changes nothing.
    before = _rows_in(store, postgres.info["dsn"])
    assert store.mutate(list(reversed(cells))) == []
    assert _rows_in(store, postgres.info["dsn"]) == before == 450


def test_scan_returns_newest_per_cell_in_range_and_columns(store: PostgresCellStore) -> None:
    cells = [Cell(f"r{r}".encode(), "f:q", ts, bytes([r, ts])) for r in range(5) for ts in (1, 2)]
    cells += [Cell(b"r1", "g:other", 9, b"x")]
    assert store.mutate(cells) == []
    scanned = list(store.scan(start_row=b"r1", stop_row=b"r3"))
    assert [(c.row, c.column, c.timestamp) for c in scanned] == [
        (b"r1", "f:q", 2),
        (b"r1", "g:other", 9),
        (b"r2", "f:q", 2),
    ]
    only_f = list(store.scan(columns=["f:q"], limit=2))
    assert [(c.row, c.value) for c in only_f] == [(b"r0", bytes([0, 2])), (b"r1", bytes([1, 2]))]


def test_buffered_mutator_flushes_by_count_and_bytes(store: PostgresCellStore, postgres: ServiceState) -> None:
    mutator = BufferedMutator(store, max_cells=10, max_bytes=10_000)
    for i in range(25):
        mutator.mutate(Cell(b"row", "f:q", i, b"v"))
    assert _rows_in(store, postgres.info["dsn"]) == 20  # two flushes of 10; 5 still buffered
    mutator.flush()
    assert _rows_in(store, postgres.info["dsn"]) == 25
    by_bytes = BufferedMutator(store, max_cells=1_000, max_bytes=3_000)
    for i in range(3):
        by_bytes.mutate(Cell(b"big", "f:q", i, b"x" * 1_400))
    assert store.get(b"big", "f:q") is not None  # the second cell crossed 3,000 bytes and flushed


def test_salted_keys_are_deterministic_and_spread(store: PostgresCellStore) -> None:
    salter = RowKeySalter(8)
    keys = [f"2024-01-01T00:{m:02d}:{s:02d}".encode() for m in range(10) for s in range(60)]
    assert [salter.salt(k) for k in keys] == [RowKeySalter(8).salt(k) for k in keys]
    buckets = {salter.bucket(k) for k in keys}
    assert buckets == set(range(8))
    assert all(salter.unsalt(salter.salt(k)) == k for k in keys)
    mutator = BufferedMutator(store, salter=salter)
    for i, key in enumerate(keys):
        mutator.mutate(Cell(key, "e:count", 1, str(i).encode()))
    assert mutator.flush() == []
    assert store.get(salter.salt(keys[42]), "e:count") == Cell(salter.salt(keys[42]), "e:count", 1, b"42")
    per_bucket = [len(list(store.scan(start_row=p, stop_row=bytes([p[0] + 1])))) for p in salter.prefixes()]
    assert sum(per_bucket) == len(keys) and min(per_bucket) > 0


def test_invalid_cells_are_rejected_clearly() -> None:
    with pytest.raises(ValueError, match="family:qualifier"):
        Cell(b"r", "no-family", 1, b"v")
    with pytest.raises(ValueError, match="timestamp"):
        Cell(b"r", "f:q", "yesterday", b"v")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bytes"):
        Cell(b"r", "f:q", 1, "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buckets"):
        RowKeySalter(0)
    assert split_column("f:a:b") == ("f", "a:b")
