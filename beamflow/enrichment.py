"""Dimension lookups that do not stall a pipeline: batched, bounded in flight, cached, retried. No Beam.

The shape follows Beam's ``EnrichmentSourceHandler`` (a handler opened with ``__enter__``, closed with ``__exit__``,
with a cache key per request) so handlers look familiar, but the work is done here, not in Beam 2.62's ``Enrichment``
(which needs the GCP extra, looks up one request at a time, fails the pipeline on a timeout and re-stamps batched
elements to the end of the global window; ``docs`` and the research note have the details):

- ``LookupHandler.lookup(keys)`` answers a whole batch of keys in one round trip (``WHERE key = ANY(%s)``);
- ``LookupCache``: per worker, LRU with a size bound, a TTL for found rows and a shorter one for missing keys, and an
  injectable clock;
- ``BatchedLookups``: collects keys into batches, keeps at most ``max_in_flight`` batches running on a thread pool
  (psycopg releases the GIL during network I/O), retries a failed batch with exponential backoff and jitter while it
  is transient (a restarted server, a timeout), and hands each caller back its items with their rows. A key already
  pending or in flight is not looked up again: its item joins the lookup under way. ``drain`` waits for every batch
  in flight, so a bundle never ends with a lookup outstanding. When the retry budget is spent the
  error is raised (``StoreUnavailable``): the runner fails and retries the bundle instead of dead-lettering every
  element of an outage.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

__all__ = [
    "MISSING_POLICIES",
    "BatchedLookups",
    "LookupCache",
    "LookupHandler",
    "LookupRetry",
    "LookupStats",
    "StoreUnavailable",
]

Item = TypeVar("Item")
Row = Mapping[str, Any]

# pass: the element goes on with the dimension's columns as None; dead_letter: it goes to the dead letters.
MISSING_POLICIES = ("pass", "dead_letter")


class StoreUnavailable(RuntimeError):
    """The lookup store did not answer within the retry budget: the bundle must fail (and be retried)."""


class LookupHandler(Protocol):
    """A lookup source (Beam's ``EnrichmentSourceHandler`` shape, batched).

    ``__enter__`` opens connections (once per worker), ``__exit__`` closes them; ``lookup`` answers a batch of keys
    with the rows found (missing keys are simply absent) and must be safe to call from several threads at once;
    ``columns`` are the fields a row contributes (a missing key passes on with these set to None);
    ``is_transient(exc)`` tells a retryable failure from a bug.
    """

    columns: tuple[str, ...]

    def __enter__(self) -> LookupHandler: ...

    def __exit__(self, *exc: object) -> None: ...

    def lookup(self, keys: Sequence[Hashable]) -> dict[Hashable, Row]: ...

    def is_transient(self, exc: BaseException) -> bool: ...

    def cache_key(self, key: Hashable) -> Hashable: ...


@dataclass(frozen=True)
class LookupRetry:
    """Exponential backoff with full jitter for one batch: attempt n sleeps uniform(0, min(max_delay, base * 2**n)).

    ``max_elapsed`` bounds the whole batch (attempts and pauses): past it the batch raises ``StoreUnavailable``.
    """

    max_attempts: int = 30
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0
    max_elapsed_s: float = 60.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0, min(self.max_delay_s, self.base_delay_s * (2**attempt)))


class LookupCache:
    """Per-worker LRU cache of lookup results with a size bound and TTLs (found rows, and missing keys apart).

    ``clock`` returns seconds (monotonic by default; tests pass their own). Thread-safe.
    """

    def __init__(
        self,
        max_entries: int = 100_000,
        ttl_s: float = 300.0,
        missing_ttl_s: float | None = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0 or ttl_s < 0:
            raise ValueError("max_entries and ttl_s must not be negative")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.missing_ttl_s = ttl_s if missing_ttl_s is None else missing_ttl_s
        self._clock = clock
        self._entries: OrderedDict[Hashable, tuple[float, Row | None]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    ABSENT: ClassVar[object] = object()

    def get(self, key: Hashable) -> Any:
        """The cached row, None for a cached miss, or ``LookupCache.ABSENT`` when not cached (or expired)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                if self._clock() < entry[0]:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return entry[1]
                del self._entries[key]  # expired
            self.misses += 1
            return self.ABSENT

    def put(self, key: Hashable, row: Row | None) -> None:
        if self.max_entries == 0:
            return
        ttl = self.ttl_s if row is not None else self.missing_ttl_s
        if ttl <= 0:
            return
        with self._lock:
            self._entries[key] = (self._clock() + ttl, row)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class LookupStats:
    batches: int = 0
    keys_looked_up: int = 0
    retries: int = 0
    cache_hits: int = 0
    missing: int = 0
    attached: int = 0  # items answered by a batch already in flight for their key


class BatchedLookups(Generic[Item]):
    """Looks up the keys of items in batches with bounded concurrency; see the module docstring.

    ``add(item, key)`` returns the (item, row) pairs that are ready now (cache hits and finished batches), ``drain()``
    the rest once every batch in flight has finished. A row is None for a key the store does not have. Each key is
    looked up at most once at a time: an item whose key is pending or in flight waits for that lookup's answer.
    A batch that keeps failing raises ``StoreUnavailable`` from ``add``, ``ready`` or ``drain``; its items are not
    returned (the caller's bundle fails and is retried whole).

    ``cached(key)`` and ``submit(item, key)`` are ``add`` in two halves, for a caller that answers cache hits itself
    (``Enrich`` emits them without building a pair); ``ready()`` returns the items of batches finished so far.
    """

    def __init__(
        self,
        handler: LookupHandler,
        *,
        max_batch_size: int = 500,
        max_in_flight: int = 4,
        cache: LookupCache | None = None,
        retry: LookupRetry = LookupRetry(),
        executor: ThreadPoolExecutor | None = None,
        seed: int | None = None,
    ) -> None:
        if max_batch_size < 1 or max_in_flight < 1:
            raise ValueError("max_batch_size and max_in_flight must be at least 1")
        self.handler = handler
        self.max_batch_size = max_batch_size
        self.max_in_flight = max_in_flight
        self.cache = cache
        self.retry = retry
        self.stats = LookupStats()
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_in_flight, thread_name_prefix="beamflow-lookup")
        self._pending: dict[Hashable, list[Item]] = {}
        self._in_flight: dict[Future[dict[Hashable, Row]], dict[Hashable, list[Item]]] = {}
        # key -> the item list of the batch in flight for it (the same list object as in ``_in_flight``): a later item
        # with that key is appended there instead of starting a second lookup before the first answer is cached.
        self._flying: dict[Hashable, list[Item]] = {}
        # Batches whose lookup has ended, appended by a done-callback: asking every future in flight ``done()`` (a
        # lock each) on every item was most of a miss's cost.
        self._finished: deque[Future[dict[Hashable, Row]]] = deque()
        self._cache_key = handler.cache_key
        self._rng = random.Random(seed)
        self._stats_lock = threading.Lock()

    # ---- feeding ----------------------------------------------------------------------------------------------

    def add(self, item: Item, key: Hashable) -> list[tuple[Item, Row | None]]:
        cached = self.cached(key)
        if cached is not LookupCache.ABSENT:
            return [(item, cached)]
        return self.submit(item, key)

    def cached(self, key: Hashable) -> Any:
        """The cached row of ``key`` (None: cached as missing; counted as a hit), or ``LookupCache.ABSENT``."""
        if self.cache is None:
            return LookupCache.ABSENT
        row = self.cache.get(self._cache_key(key))
        if row is not LookupCache.ABSENT:
            self.stats.cache_hits += 1
            if row is None:
                self.stats.missing += 1
        return row

    def submit(self, item: Item, key: Hashable) -> list[tuple[Item, Row | None]]:
        """Queues ``item`` for ``key``'s lookup (the cache not asked); returns the pairs of batches finished now."""
        waiting = self._pending.get(key)
        if waiting is not None:
            waiting.append(item)
            return self._harvest(block=False)
        flying = self._flying.get(key)
        if flying is not None:
            flying.append(item)
            self.stats.attached += 1
            return self._harvest(block=False)
        self._pending[key] = [item]
        ready = self._submit_pending() if len(self._pending) >= self.max_batch_size else []
        ready.extend(self._harvest(block=False))
        return ready

    def ready(self) -> list[tuple[Item, Row | None]]:
        """The pairs of batches that have finished (without waiting)."""
        return self._harvest(block=False)

    def drain(self) -> list[tuple[Item, Row | None]]:
        """Submits what is pending and waits for every batch in flight."""
        ready = self._submit_pending()
        while self._in_flight:
            ready.extend(self._harvest(block=True))
        return ready

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)

    # ---- batches ----------------------------------------------------------------------------------------------

    def _submit_pending(self) -> list[tuple[Item, Row | None]]:
        ready: list[tuple[Item, Row | None]] = []
        if not self._pending:
            return ready
        while len(self._in_flight) >= self.max_in_flight:  # the bound: wait for a slot before submitting more
            ready.extend(self._harvest(block=True))
        batch, self._pending = self._pending, {}
        future = self._executor.submit(self._lookup_with_retries, list(batch))
        self._in_flight[future] = batch
        self._flying.update(batch)
        future.add_done_callback(self._finished.append)
        return ready

    def _harvest(self, block: bool) -> list[tuple[Item, Row | None]]:
        finished = self._finished
        if not finished and (not block or not self._in_flight):
            return []
        done: set[Future[dict[Hashable, Row]]] = set()
        if block and not finished:
            # A waiter may wake before the done-callbacks have run: take the futures ``wait`` names as well.
            done, _ = wait(list(self._in_flight), return_when=FIRST_COMPLETED)
        while finished:
            done.add(finished.popleft())
        ready: list[tuple[Item, Row | None]] = []
        for future in done:
            batch = self._in_flight.pop(future, None)
            if batch is None:  # harvested already (named by ``wait`` before its callback ran)
                continue
            for key in batch:  # from here on its keys are answered by the cache (or a new lookup)
                del self._flying[key]
            rows = future.result()  # StoreUnavailable (or a bug) propagates to the caller's bundle
            for key, items in batch.items():
                row = rows.get(key)
                if self.cache is not None:
                    self.cache.put(self._cache_key(key), row)
                if row is None:
                    self.stats.missing += len(items)
                ready.extend((item, row) for item in items)
        return ready

    def _lookup_with_retries(self, keys: list[Hashable]) -> dict[Hashable, Row]:
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                rows = self.handler.lookup(keys)
                with self._stats_lock:
                    self.stats.batches += 1
                    self.stats.keys_looked_up += len(keys)
                return rows
            except Exception as exc:
                if not self.handler.is_transient(exc):
                    raise
                attempt += 1
                elapsed = time.monotonic() - started
                if attempt >= self.retry.max_attempts or elapsed >= self.retry.max_elapsed_s:
                    raise StoreUnavailable(
                        f"lookup store unavailable after {attempt} attempts in {elapsed:.1f}s: {exc}"
                    ) from exc
                with self._stats_lock:
                    self.stats.retries += 1
                    pause = self.retry.delay(attempt, self._rng)
                time.sleep(min(pause, max(0.0, self.retry.max_elapsed_s - elapsed)))
