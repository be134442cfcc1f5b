"""``LookupCache``: size bound (LRU), TTL for rows and a shorter one for missing keys, on an injected clock."""

from __future__ import annotations

import pytest

from beamflow.enrichment import LookupCache

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rows_expire_after_ttl_and_missing_keys_after_their_own_ttl() -> None:
    clock = Clock()
    cache = LookupCache(max_entries=10, ttl_s=60, missing_ttl_s=5, clock=clock)
    cache.put("d1", {"name": "Ann"})
    cache.put("unknown", None)
    assert cache.get("d1") == {"name": "Ann"}
    assert cache.get("unknown") is None  # a cached miss, not "absent"
    clock.now += 5
    assert cache.get("unknown") is LookupCache.ABSENT
    assert cache.get("d1") == {"name": "Ann"}
    clock.now += 55
    assert cache.get("d1") is LookupCache.ABSENT
    assert cache.hits == 3 and cache.misses == 2


def test_least_recently_used_entry_is_evicted_at_the_size_bound() -> None:
    cache = LookupCache(max_entries=2, ttl_s=60, clock=Clock())
    cache.put("a", {"v": 1})
    cache.put("b", {"v": 2})
    assert cache.get("a") == {"v": 1}  # a is now the most recently used
    cache.put("c", {"v": 3})
    assert cache.get("b") is LookupCache.ABSENT
    assert cache.get("a") == {"v": 1} and cache.get("c") == {"v": 3}
    assert len(cache) == 2 and cache.evictions == 1


def test_size_zero_caches_nothing() -> None:
    cache = LookupCache(max_entries=0, clock=Clock())
    cache.put("a", {"v": 1})
    assert cache.get("a") is LookupCache.ABSENT
