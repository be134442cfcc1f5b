"""``Enrich``: join each element with a dimension row looked up by key, in batches that do not stall the pipeline."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.utils.windowed_value import WindowedValue

from beamflow.deadletter import DeadLetter, encode_payload
from beamflow.enrichment import MISSING_POLICIES, BatchedLookups, LookupCache, LookupHandler, LookupRetry

__all__ = ["METRICS_NAMESPACE", "Enrich", "EnrichResult", "join_columns"]

METRICS_NAMESPACE = "beamflow.enrich"
_ENRICHED = "enriched"
_DEAD = "dead_letters"


class EnrichResult(NamedTuple):
    """``enriched``: every element joined with its row (or with None columns under ``on_missing='pass'``);
    ``dead_letters``: ``DeadLetter`` for elements without a key, or with an unknown key under ``'dead_letter'``."""

    enriched: beam.PCollection
    dead_letters: beam.PCollection


def join_columns(element: Any, row: Mapping[str, Any] | None, columns: tuple[str, ...]) -> Any:
    """The default join: a dict of the element's fields plus the row's ``columns`` (None when the row is missing).
    The element wins where both have a field (as Beam's ``cross_join`` keeps the left value)."""
    out = dict(row) if row is not None else dict.fromkeys(columns)
    out.update(element)
    return out


class _Timed(NamedTuple):
    element: Any
    key: Hashable
    timestamp: Any
    windows: Any
    pane: Any


class _EnrichFn(beam.DoFn):
    def __init__(
        self,
        handler: LookupHandler,
        key_of: Callable[[Any], Hashable | None],
        join: Callable[[Any, Mapping[str, Any] | None], Any] | None,
        on_missing: str,
        max_batch_size: int,
        max_in_flight: int,
        cache_size: int,
        cache_ttl_s: float,
        missing_ttl_s: float | None,
        retry: LookupRetry,
        stage: str,
    ) -> None:
        self._handler = handler
        self._key_of = key_of
        self._join = join
        self._on_missing = on_missing
        self._max_batch_size = max_batch_size
        self._max_in_flight = max_in_flight
        self._cache_size = cache_size
        self._cache_ttl_s = cache_ttl_s
        self._missing_ttl_s = missing_ttl_s
        self._retry = retry
        self._stage = stage
        self._lookups: BatchedLookups[_Timed] | None = None

    def setup(self) -> None:
        self._handler.__enter__()
        cache = LookupCache(self._cache_size, self._cache_ttl_s, self._missing_ttl_s) if self._cache_size else None
        self._lookups = BatchedLookups(
            self._handler,
            max_batch_size=self._max_batch_size,
            max_in_flight=self._max_in_flight,
            cache=cache,
            retry=self._retry,
        )
        self._enriched = Metrics.counter(METRICS_NAMESPACE, "enriched")
        self._missing = Metrics.counter(METRICS_NAMESPACE, "missing_keys")
        self._dead = Metrics.counter(METRICS_NAMESPACE, "dead_letters")
        self._hits = Metrics.counter(METRICS_NAMESPACE, "cache_hits")
        self._batches = Metrics.counter(METRICS_NAMESPACE, "batches")
        self._retries = Metrics.counter(METRICS_NAMESPACE, "retries")
        self._reported = (0, 0, 0)

    def teardown(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
        self._handler.__exit__(None, None, None)

    def process(
        self,
        element: Any,
        timestamp: Any = beam.DoFn.TimestampParam,
        window: Any = beam.DoFn.WindowParam,
        pane: Any = beam.DoFn.PaneInfoParam,
    ) -> Iterator[Any]:
        assert self._lookups is not None
        try:
            key = self._key_of(element)
            problem = "key is None"
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            key, problem = None, f"{type(exc).__name__}: {exc}"
        if key is None:
            yield self._dead_letter(_Timed(element, None, timestamp, (window,), pane), f"no lookup key ({problem})")
            return
        yield from self._emit(self._lookups.add(_Timed(element, key, timestamp, (window,), pane), key))

    def finish_bundle(self) -> Iterator[Any]:
        # Every lookup in flight finishes before the bundle ends: nothing the runner has not seen outlives it.
        assert self._lookups is not None
        yield from self._emit(self._lookups.drain())
        self._report()

    def _emit(self, ready: list[tuple[_Timed, Mapping[str, Any] | None]]) -> Iterator[Any]:
        for item, row in ready:
            if row is None:
                self._missing.inc()
                if self._on_missing == "dead_letter":
                    yield self._dead_letter(item, f"no {self._stage} row for key {item.key!r}", "MissingKey")
                    continue
            self._enriched.inc()
            value = self._join(item.element, row) if self._join is not None else self._default_join(item, row)
            # Each element leaves with its own timestamp, window and pane (Beam 2.62's batched Enrichment did not).
            yield WindowedValue(value, item.timestamp, item.windows, item.pane)

    def _default_join(self, item: _Timed, row: Mapping[str, Any] | None) -> Any:
        return join_columns(item.element, row, self._handler.columns)

    def _dead_letter(self, item: _Timed, reason: str, error: str = "NoKey") -> TaggedOutput:
        self._dead.inc()
        element = item.element
        kafka = element.get("_kafka") if isinstance(element, Mapping) else None
        coordinates: dict[str, Any] = {}
        if isinstance(kafka, Mapping):
            coordinates = {k: kafka.get(k) for k in ("topic", "partition", "offset")}
        dead = DeadLetter(encode_payload(element), f"enrich:{self._stage}", reason, error=error, **coordinates)
        return TaggedOutput(_DEAD, WindowedValue(dead, item.timestamp, item.windows, item.pane))

    def _report(self) -> None:
        assert self._lookups is not None
        stats = self._lookups.stats
        now = (stats.cache_hits, stats.batches, stats.retries)
        before = self._reported
        self._hits.inc(now[0] - before[0])
        self._batches.inc(now[1] - before[1])
        self._retries.inc(now[2] - before[2])
        self._reported = now


class _Field:
    """Picklable ``element[field]``."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __call__(self, element: Mapping[str, Any]) -> Hashable | None:
        value: Hashable | None = element[self.field]
        return value


class Enrich(beam.PTransform):
    """Joins each element with the row its key finds in a lookup source; returns ``EnrichResult``.

    ::

        import apache_beam as beam
        import psycopg
        from beamflow.postgres.lookups import PostgresTableLookup
        from runners.direct import local_options
        from transforms import Enrich

        dsn = "postgresql://postgres@127.0.0.1:5432/beamflow"
        with psycopg.connect(dsn) as conn:   # the dimension table
            conn.execute("CREATE TABLE IF NOT EXISTS example_drivers (driver_id text PRIMARY KEY, driver_name text,"
                         " rating real)")
            conn.execute("INSERT INTO example_drivers VALUES ('d1', 'Ada', 4.9) ON CONFLICT DO NOTHING")
        drivers = PostgresTableLookup(dsn, "example_drivers", key_column="driver_id", columns=("driver_name", "rating"))
        rides = [{"ride_id": 1, "driver_id": "d1"}, {"ride_id": 2, "driver_id": "d9"}, {"ride_id": 3}]
        with beam.Pipeline(options=local_options()) as p:
            result = p | beam.Create(rides) | "Drivers" >> Enrich(drivers, key_field="driver_id", on_missing="pass")
            result.enriched | "Enriched" >> beam.Map(print)   # {**ride, "driver_name": ..., "rating": ...}
            result.dead_letters | "NoKey" >> beam.Map(print)   # ride 3: no driver_id

    Lookups are batched (one statement per batch of distinct keys, ``max_batch_size``), at most ``max_in_flight``
    batches run at once on a thread pool per worker, answers are cached per worker (LRU ``cache_size`` entries,
    ``cache_ttl_s`` for rows, ``missing_ttl_s`` for unknown keys; ``cache_size=0`` disables it). Output order is
    not input order (Flink's unordered async wait); every element keeps its timestamp, window and pane.

    Guarantee: every element comes out exactly once per bundle attempt, enriched or (unknown key under
    ``on_missing='dead_letter'``, or no key) as a dead letter; every lookup in flight finishes before its bundle
    ends, so nothing is lost across checkpoints. A failing lookup is retried with backoff (``retry``) while the error
    is transient (a restarted or slow server); when the budget is spent the bundle fails and the runner retries it:
    an outage is never turned into dead letters. The rows are what the source held at lookup time (or up to a TTL
    earlier from the cache): a replayed bundle may see newer dimension rows.

    Handlers: ``beamflow.postgres.lookups.PostgresTableLookup`` (a table, by a key column) and ``CellStoreLookup``
    (the newest cells of ``WriteVersionedCells`` rows, so a sink's table is also a lookup source, as HBase is in
    seed 002). Any object with the ``beamflow.enrichment.LookupHandler`` shape works.

    Needs: the lookup source reachable from the workers.
    """

    def __init__(
        self,
        handler: LookupHandler,
        *,
        key_field: str | None = None,
        key_fn: Callable[[Any], Hashable | None] | None = None,
        join_fn: Callable[[Any, Mapping[str, Any] | None], Any] | None = None,
        on_missing: str = "pass",
        max_batch_size: int = 500,
        max_in_flight: int = 4,
        cache_size: int = 100_000,
        cache_ttl_s: float = 300.0,
        missing_ttl_s: float | None = 30.0,
        retry: LookupRetry = LookupRetry(),
        label: str | None = None,
    ) -> None:
        super().__init__(label)
        if (key_field is None) == (key_fn is None):
            raise ValueError("Enrich needs exactly one of key_field= or key_fn=")
        if on_missing not in MISSING_POLICIES:
            raise ValueError(f"on_missing must be one of {', '.join(MISSING_POLICIES)}, not {on_missing!r}")
        key_of = key_fn if key_fn is not None else _Field(str(key_field))
        stage = str(getattr(handler, "name", type(handler).__name__))
        self._fn = _EnrichFn(
            handler,
            key_of,
            join_fn,
            on_missing,
            max_batch_size,
            max_in_flight,
            cache_size,
            cache_ttl_s,
            missing_ttl_s,
            retry,
            stage,
        )

    def expand(self, elements: beam.PCollection) -> EnrichResult:
        out = elements | "Lookup" >> beam.ParDo(self._fn).with_outputs(_DEAD, main=_ENRICHED)
        return EnrichResult(out[_ENRICHED], out[_DEAD])
