"""``Enrich``: join each element with a dimension row looked up by key, in batches that do not stall the pipeline."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.transforms.window import FixedWindows, GlobalWindows, Sessions
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


# Windowing functions that give every element exactly one window. Under any other (sliding windows, custom ones)
# Enrich asks Beam for the window too, which makes Beam call ``process`` once per window of an element.
_ONE_WINDOW_FNS = (GlobalWindows, FixedWindows, Sessions)


class _EnrichFn(beam.DoFn):
    """The lookup step. Its per-element cost is most of Enrich's, so it asks Beam for as little as it can: only the
    ``WindowedValue`` of each element (Beam's cheapest windowed parameter: no per-window argument rebuilding), not
    the timestamp, window and pane apart. A cache hit is yielded as a plain value (Beam gives it the element's own
    timestamp, window and pane); only an answer that arrives after its element's ``process`` call has returned is
    emitted as an explicit ``WindowedValue``: the element's own, with the joined value.
    """

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
        self._lookups: BatchedLookups[WindowedValue] | None = None

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
        # In the order of ``_counts``.
        names = ("cache_hits", "attached", "batches", "retries", "enriched", "missing_keys", "dead_letters")
        self._counters = [Metrics.counter(METRICS_NAMESPACE, name) for name in names]
        # Counted in plain ints and reported once per bundle: a Beam counter's inc per element costs as much as a
        # cache hit's whole lookup.
        self._enriched = self._missing = self._dead = 0
        self._reported = self._counts()
        # Answers finished while an element with several windows was current, emitted at the next one-window element
        # or at the bundle's end (see ``_later``).
        self._held: list[Any] = []

    def start_bundle(self) -> None:
        self._held = []
        # Counts of a failed attempt are not this bundle's (the runner drops its committed metrics too).
        self._reported = self._counts()

    def teardown(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
        self._handler.__exit__(None, None, None)

    def process(self, element: Any, wv: Any = beam.DoFn.WindowedValueParam) -> Iterator[Any]:
        lookups = self._lookups
        assert lookups is not None
        if self._held and len(wv.windows) == 1:
            yield from self._held
            self._held = []
        try:
            key = self._key_of(element)
            problem = "key is None"
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            key, problem = None, f"{type(exc).__name__}: {exc}"
        if key is None:
            yield self._dead_letter(element, f"no lookup key ({problem})")
            return
        row = lookups.cached(key)
        if row is LookupCache.ABSENT:
            ready = lookups.submit(wv, key)
        else:
            # Answered now: a plain value, which Beam stamps with this element's timestamp, windows and pane.
            if row is not None or self._on_missing == "pass":
                self._enriched += 1
                yield self._join(element, row) if self._join is not None else join_columns(element, row, self._columns)
            else:
                self._missing += 1
                yield self._dead_letter(element, f"no {self._stage} row for key {key!r}", "MissingKey")
            if not lookups.in_flight:
                return
            ready = lookups.ready()
        if ready:
            yield from self._later(ready, wv)

    def finish_bundle(self) -> Iterator[Any]:
        # Every lookup in flight finishes before the bundle ends: nothing the runner has not seen outlives it.
        assert self._lookups is not None
        yield from self._held
        self._held = []
        yield from self._emit(self._lookups.drain())
        self._report()

    def _later(self, ready: list[tuple[WindowedValue, Mapping[str, Any] | None]], current: WindowedValue) -> Any:
        """Answers for earlier elements, each as its element's own ``WindowedValue``.

        Beam multiplies the windows of a ``WindowedValue`` yielded while the current element has n != 1 windows by n
        (it assumes the value came from that element): such answers are held until a one-window element or the
        bundle's end. Only an input whose windowing function is not one of ``_ONE_WINDOW_FNS`` can get here, and
        ``Enrich`` makes Beam split those elements per window (``_PerWindowEnrichFn``).
        """
        if len(current.windows) == 1:
            return self._emit(ready)
        self._held.extend(self._emit(ready))
        return ()

    def _emit(self, ready: list[tuple[WindowedValue, Mapping[str, Any] | None]]) -> Iterator[Any]:
        for wv, row in ready:
            element = wv.value
            if row is None:
                self._missing += 1
                if self._on_missing == "dead_letter":
                    reason = f"no {self._stage} row for key {self._key_of(element)!r}"
                    yield TaggedOutput(_DEAD, wv.with_value(self._dead_letter_of(element, reason, "MissingKey")))
                    continue
            self._enriched += 1
            value = self._join(element, row) if self._join is not None else join_columns(element, row, self._columns)
            # The element's own timestamp, windows and pane (Beam 2.62's batched Enrichment re-stamped them).
            yield wv.with_value(value)

    @property
    def _columns(self) -> tuple[str, ...]:
        return self._handler.columns

    def _dead_letter(self, element: Any, reason: str, error: str = "NoKey") -> TaggedOutput:
        return TaggedOutput(_DEAD, self._dead_letter_of(element, reason, error))

    def _dead_letter_of(self, element: Any, reason: str, error: str) -> DeadLetter:
        self._dead += 1
        kafka = element.get("_kafka") if isinstance(element, Mapping) else None
        coordinates: dict[str, Any] = {}
        if isinstance(kafka, Mapping):
            coordinates = {k: kafka.get(k) for k in ("topic", "partition", "offset")}
        return DeadLetter(encode_payload(element), f"enrich:{self._stage}", reason, error=error, **coordinates)

    def _report(self) -> None:
        now = self._counts()
        for counter, n, before in zip(self._counters, now, self._reported, strict=True):
            if n != before:
                counter.inc(n - before)
        self._reported = now

    def _counts(self) -> list[int]:
        assert self._lookups is not None
        stats = self._lookups.stats
        return [
            stats.cache_hits,
            stats.attached,
            stats.batches,
            stats.retries,
            self._enriched,
            self._missing,
            self._dead,
        ]


class _PerWindowEnrichFn(_EnrichFn):
    """``_EnrichFn`` for inputs whose elements may have several windows: asking for the window makes Beam call
    ``process`` once per window, so each answer leaves in exactly one window, never held back."""

    def process(
        self, element: Any, wv: Any = beam.DoFn.WindowedValueParam, window: Any = beam.DoFn.WindowParam
    ) -> Iterator[Any]:
        return super().process(element, wv)


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
    ``cache_ttl_s`` for rows, ``missing_ttl_s`` for unknown keys; ``cache_size=0`` disables it). A key is looked up
    once at a time: elements whose key is already pending or in flight wait for that lookup's answer. Output order
    is not input order (Flink's unordered async wait: a cache hit leaves at once, a miss when its batch returns);
    every element keeps its timestamp, window(s) and pane (under windowing that gives an element several windows,
    one output per window, with the pane Beam gives each window's call).

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
        self._fn_args = (
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
        one_window = isinstance(elements.windowing.windowfn, _ONE_WINDOW_FNS)
        fn = (_EnrichFn if one_window else _PerWindowEnrichFn)(*self._fn_args)
        out = elements | "Lookup" >> beam.ParDo(fn).with_outputs(_DEAD, main=_ENRICHED)
        return EnrichResult(out[_ENRICHED], out[_DEAD])
