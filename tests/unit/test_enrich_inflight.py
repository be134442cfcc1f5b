"""``BatchedLookups``: an item whose key is already in flight joins that lookup instead of starting another one."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import pytest

from beamflow.enrichment import BatchedLookups, LookupCache, LookupRetry, StoreUnavailable

pytestmark = pytest.mark.unit


class GatedRows:
    """A lookup source whose batches wait for ``gate``, so the test decides how long a batch stays in flight."""

    columns = ("v",)

    def __init__(self, fail: bool = False) -> None:
        self.gate = threading.Event()
        self.calls: list[list[Hashable]] = []
        self.fail = fail
        self._lock = threading.Lock()

    def __enter__(self) -> GatedRows:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError)

    def cache_key(self, key: Hashable) -> Hashable:
        return key

    def lookup(self, keys: Sequence[Hashable]) -> dict[Hashable, Mapping[str, Any]]:
        with self._lock:
            self.calls.append(list(keys))
        assert self.gate.wait(10)
        if self.fail:
            raise ConnectionError("down")
        return {k: {"v": f"row {k}"} for k in keys if k != "unknown"}


@pytest.mark.parametrize("cached", [True, False])
def test_items_of_a_key_in_flight_join_its_lookup(cached: bool) -> None:
    rows = GatedRows()
    lookups: BatchedLookups[int] = BatchedLookups(
        rows, max_batch_size=2, max_in_flight=4, cache=LookupCache(100, 60) if cached else None
    )
    ready = lookups.add(0, "a") + lookups.add(1, "unknown")  # a full batch: submitted, held at the gate
    assert lookups.in_flight == 1 and ready == []
    for i in range(2, 8):  # the same keys again while their batch is in flight
        ready += lookups.add(i, "a" if i % 2 == 0 else "unknown")
    assert lookups.in_flight == 1 and ready == []  # nothing else submitted
    rows.gate.set()
    ready += lookups.drain()
    lookups.close()
    assert rows.calls == [["a", "unknown"]]  # each key looked up once
    assert lookups.stats.attached == 6 and lookups.stats.batches == 1
    assert sorted(ready, key=lambda pair: pair[0]) == [(i, {"v": "row a"} if i % 2 == 0 else None) for i in range(8)]
    assert lookups.stats.missing == 4


def test_after_the_answer_a_key_is_no_longer_attached() -> None:
    rows = GatedRows()
    rows.gate.set()
    lookups: BatchedLookups[int] = BatchedLookups(rows, max_batch_size=1, cache=LookupCache(100, 60))
    first = lookups.add(0, "a") + lookups.drain()
    again = lookups.add(1, "a") + lookups.drain()  # from the cache now
    no_cache: BatchedLookups[int] = BatchedLookups(rows, max_batch_size=1)
    third = no_cache.add(2, "a") + no_cache.drain() + no_cache.add(3, "a") + no_cache.drain()
    lookups.close()
    no_cache.close()
    assert first == [(0, {"v": "row a"})] and again == [(1, {"v": "row a"})]
    assert third == [(2, {"v": "row a"}), (3, {"v": "row a"})]
    assert rows.calls == [["a"], ["a"], ["a"]]  # the finished batch takes nobody new: a fresh lookup without cache
    assert lookups.stats.attached == 0 and no_cache.stats.attached == 0


def test_a_failed_batch_raises_and_its_keys_are_looked_up_afresh() -> None:
    rows = GatedRows(fail=True)
    retry = LookupRetry(max_attempts=2, base_delay_s=0.0, max_delay_s=0.0)
    lookups: BatchedLookups[int] = BatchedLookups(rows, max_batch_size=1, retry=retry)
    lookups.add(0, "a")
    lookups.add(1, "a")  # attached to the failing batch
    rows.gate.set()
    with pytest.raises(StoreUnavailable):
        lookups.drain()
    rows.fail = False
    # The failed batch's items are gone with its bundle; the key is not attached to a dead batch.
    assert lookups.add(2, "a") + lookups.drain() == [(2, {"v": "row a"})]
    lookups.close()
    assert lookups.stats.attached == 1
