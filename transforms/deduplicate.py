"""``DeduplicateEvents``: drop replayed events by event id, and keep every duplicate in a quarantine output."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.trigger import DefaultTrigger
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.transforms.window import GlobalWindows, TimestampedValue
from apache_beam.utils.timestamp import Duration, Timestamp

from transforms._global_window import in_global_window
from transforms._run_mode import is_batch_bounded

__all__ = [
    "METRICS_NAMESPACE",
    "STRATEGIES",
    "DeduplicateEvents",
    "DeduplicateResult",
    "FirstCopyTable",
    "QuarantinedEvent",
    "kafka_position",
]

# auto: store when a table is given, else grouped for bounded input in a batch run, else state.
STRATEGIES = ("auto", "state", "grouped", "store")

METRICS_NAMESPACE = "beamflow.deduplicate"

_UNIQUE = "unique"
_QUARANTINE = "quarantine"


@dataclass(frozen=True)
class QuarantinedEvent:
    """An event that was not passed on, with why: a duplicate (``event_id`` set) or an event without an id.

    ``first_seen`` is the event time of the copy that was kept; ``event_time`` that of this copy.
    """

    event: Any
    event_id: Hashable | None
    reason: str
    event_time: Timestamp
    first_seen: Timestamp | None = None


class DeduplicateResult(NamedTuple):
    """The two outputs of ``DeduplicateEvents``: ``unique`` events and ``quarantine`` (``QuarantinedEvent``)."""

    unique: beam.PCollection
    quarantine: beam.PCollection


class _KeyById(beam.DoFn):
    """(id, event) for events with an id; events without one go to quarantine instead of being dropped."""

    def __init__(self, id_of: Callable[[Any], Hashable | None], what: str, with_time: bool = False) -> None:
        self._id_of = id_of
        self._what = what
        self._with_time = with_time
        self._missing = Metrics.counter(METRICS_NAMESPACE, "missing_id")

    def process(self, event: Any, timestamp: Any = beam.DoFn.TimestampParam) -> Any:
        try:
            event_id = self._id_of(event)
        except (KeyError, TypeError, AttributeError) as exc:
            event_id, error = None, f"{type(exc).__name__}: {exc}"
        else:
            error = "id is None"
        if event_id is None:
            self._missing.inc()
            yield beam.pvalue.TaggedOutput(
                _QUARANTINE,
                QuarantinedEvent(event, None, f"missing event id ({self._what}; {error})", timestamp),
            )
            return
        # The grouped (bounded) path carries each copy's event time through the GroupByKey, which re-stamps values;
        # as int micros, which the shuffle's coder writes natively (a Timestamp would be pickled).
        yield (event_id, (timestamp.micros, event)) if self._with_time else (event_id, event)


class _FirstCopyPerId(beam.DoFn):
    """Keeps the first copy per id; the id's state expires by an event-time timer ``ttl`` after the first copy.

    Only an event-time timer is declared on purpose: a processing-time timer (as in Beam's ``DeduplicatePerKey``)
    makes the switching DirectRunner fall back to the legacy runner, which cannot run beamflow's splittable Kafka
    read, and makes expiry depend on wall-clock time rather than on the data.
    """

    FIRST_SEEN = ReadModifyWriteStateSpec("first_seen", PickleCoder())
    EXPIRY = TimerSpec("expiry", TimeDomain.WATERMARK)

    def __init__(self, ttl: Duration) -> None:
        self._ttl = ttl
        self._unique = Metrics.counter(METRICS_NAMESPACE, "unique")
        self._duplicates = Metrics.counter(METRICS_NAMESPACE, "duplicates")

    def process(
        self,
        element: tuple[Hashable, Any],
        timestamp: Any = beam.DoFn.TimestampParam,
        first_seen: Any = beam.DoFn.StateParam(FIRST_SEEN),
        expiry: Any = beam.DoFn.TimerParam(EXPIRY),
    ) -> Any:
        event_id, event = element
        seen_at = first_seen.read()
        if seen_at is None:
            first_seen.write(timestamp)
            expiry.set(timestamp + self._ttl)
            self._unique.inc()
            yield event
            return
        self._duplicates.inc()
        yield beam.pvalue.TaggedOutput(
            _QUARANTINE,
            QuarantinedEvent(
                event,
                event_id,
                f"duplicate of event id {event_id!r} first seen at {Timestamp.of(seen_at).to_rfc3339()}",
                timestamp,
                seen_at,
            ),
        )

    @on_timer(EXPIRY)
    def expire(self, first_seen: Any = beam.DoFn.StateParam(FIRST_SEEN)) -> None:
        first_seen.clear()


class _FirstCopyPerGroup(beam.DoFn):
    """Bounded input: all copies of one id arrive together (GroupByKey); no state, no timers.

    The copies are taken in event-time order (ties: lowest Kafka coordinates when the events carry them, else
    delivery order) and the id's TTL is applied as the stateful path applies it when the watermark follows event
    time: a copy within ``ttl`` of the kept copy is quarantined; a copy at or past ``kept + ttl`` arrives after the
    id's state would have expired, so it is kept and starts a new TTL. Every copy leaves with its own event time (the
    grouping's output timestamp, the end of the window, is not used), in the window it came in.
    """

    def __init__(self, ttl: Duration, global_window: bool = False) -> None:
        self._ttl = ttl
        # In the global window an output can be made whole (cheaper per element than a TimestampedValue).
        self._global_window = global_window
        self._unique = Metrics.counter(METRICS_NAMESPACE, "unique")
        self._duplicates = Metrics.counter(METRICS_NAMESPACE, "duplicates")

    def process(self, element: tuple[Hashable, Iterable[tuple[int, Any]]]) -> Any:
        event_id, timed_copies = element
        copies = [(Timestamp(micros=micros), event) for micros, event in timed_copies]
        if len(copies) == 1:
            self._unique.inc()
            timestamp, event = copies[0]
            yield self._at(event, timestamp)
            return
        # Equal event times: the lowest Kafka coordinates first when the events carry them (``_kafka``), so a rerun
        # keeps the same copy (downstream sinks that count events by coordinate rely on it); else delivery order.
        copies.sort(key=_time_then_coordinates)
        kept: Timestamp | None = None
        unique = duplicates = 0
        for timestamp, event in copies:
            if kept is None or timestamp >= kept + self._ttl:
                kept = timestamp
                unique += 1
                yield self._at(event, timestamp)
                continue
            duplicates += 1
            yield beam.pvalue.TaggedOutput(
                _QUARANTINE,
                TimestampedValue(
                    QuarantinedEvent(
                        event,
                        event_id,
                        f"duplicate of event id {event_id!r} first seen at {Timestamp.of(kept).to_rfc3339()}",
                        timestamp,
                        kept,
                    ),
                    timestamp,
                ),
            )
        self._unique.inc(unique)
        if duplicates:
            self._duplicates.inc(duplicates)

    def _at(self, event: Any, timestamp: Timestamp) -> Any:
        """The event at its own time, in the window it came in."""
        return in_global_window(event, timestamp) if self._global_window else TimestampedValue(event, timestamp)


@dataclass(frozen=True)
class FirstCopyTable:
    """Where the ``store`` strategy records each id's first copy: a PostgreSQL DSN and a table (created if missing)."""

    dsn: str
    table: str


def kafka_position(event: Any) -> tuple[str, int, int]:
    """(topic, partition, offset) from an event's ``_kafka`` mapping (what the clicks job's events carry)."""
    kafka = event["_kafka"]
    return kafka["topic"], kafka["partition"], kafka["offset"]


class _FirstCopyFromStore(beam.DoFn):
    """The ``store`` strategy: each bundle's copies are claimed in one transaction (``FirstCopyStore``), then passed
    on or quarantined with their own timestamps and windows. No shuffle, no per-key state, no timers."""

    def __init__(
        self,
        table: FirstCopyTable,
        ttl: Duration,
        id_of: Callable[[Any], Hashable | None],
        what: str,
        position_of: Callable[[Any], tuple[str, int, int]],
        max_batch: int = 5000,
    ) -> None:
        self._table = table
        self._ttl_ms = ttl.micros // 1000
        self._id_of = id_of
        self._what = what
        self._position_of = position_of
        self._max_batch = max_batch
        self._unique = Metrics.counter(METRICS_NAMESPACE, "unique")
        self._duplicates = Metrics.counter(METRICS_NAMESPACE, "duplicates")
        self._missing = Metrics.counter(METRICS_NAMESPACE, "missing_id")

    def setup(self) -> None:
        from beamflow.postgres.first_copies import Copy, FirstCopyStore
        from beamflow.postgres.writer import open_pool

        self._copy = Copy  # imported once here, not per element (psycopg stays out of this module's import)

        self._pool = open_pool(self._table.dsn)
        self._store = FirstCopyStore(self._pool, self._table.table, self._ttl_ms)
        self._store.create()

    def teardown(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()

    def start_bundle(self) -> None:
        self._batch: list[tuple[Any, Any]] = []

    # The windowed value itself, not TimestampParam and WindowParam: Beam resolves each parameter per element through a
    # chain of comparisons and builds a Timestamp for TimestampParam (6.8 us an element for the two against 2.6 for
    # this one, on the local runner), and a first copy leaves as the very windowed value it came in.
    def process(self, event: Any, windowed: Any = beam.DoFn.WindowedValueParam) -> Iterator[Any]:
        try:
            event_id = self._id_of(event)
            error = "id is None"
        except (KeyError, TypeError, AttributeError) as exc:
            event_id, error = None, f"{type(exc).__name__}: {exc}"
        reason = None
        if event_id is None:
            self._missing.inc()
            reason = f"missing event id ({self._what}; {error})"
        else:
            try:
                topic, partition, offset = self._position_of(event)
            except (KeyError, TypeError, AttributeError, ValueError) as exc:
                reason = f"no Kafka coordinates to tell replays from copies ({type(exc).__name__}: {exc})"
        if reason is not None:
            quarantined = QuarantinedEvent(event, event_id, reason, windowed.timestamp)
            yield beam.pvalue.TaggedOutput(_QUARANTINE, windowed.with_value(quarantined))
            return
        copy = self._copy(str(event_id), topic, int(partition), int(offset), windowed.timestamp_micros // 1000)
        self._batch.append((copy, windowed))
        if len(self._batch) >= self._max_batch:
            yield from self._flush()

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._flush()

    def _flush(self) -> Iterator[Any]:
        batch, self._batch = self._batch, []
        if not batch:
            return
        verdicts = self._store.claim([copy for copy, _ in batch])
        unique = 0
        for (copy, windowed), verdict in zip(batch, verdicts, strict=True):
            if verdict.first:
                unique += 1
                yield windowed
                continue
            first_seen = Timestamp(micros=verdict.first_ms * 1000)
            quarantined = QuarantinedEvent(
                windowed.value,
                copy.event_id,
                f"duplicate of event id {copy.event_id!r} first seen at {first_seen.to_rfc3339()}",
                windowed.timestamp,
                first_seen,
            )
            yield beam.pvalue.TaggedOutput(_QUARANTINE, windowed.with_value(quarantined))
        self._unique.inc(unique)
        if unique < len(batch):
            self._duplicates.inc(len(batch) - unique)


def _time_then_coordinates(timed: tuple[Timestamp, Any]) -> tuple[Timestamp, int, int]:
    timestamp, event = timed
    kafka = event.get("_kafka") if isinstance(event, Mapping) else None
    if isinstance(kafka, Mapping):
        return timestamp, int(kafka.get("partition", -1)), int(kafka.get("offset", -1))
    return timestamp, -1, -1


def _can_group(events: beam.PCollection) -> bool:
    """Whether the grouped path gives the stateful path's result: bounded input in a batch run, windows that
    neither merge nor fire early (one pane per window, so one group holds every copy of an id in that window)."""
    if not is_batch_bounded(events):
        # A streaming runner fires the grouping at the end of the (global) window, after the watermark has passed
        # the events' own times: re-stamped to those times they would be late downstream.
        return False
    windowing = events.windowing
    return not windowing.windowfn.is_merging() and windowing.triggerfn == DefaultTrigger()


class DeduplicateEvents(beam.PTransform):
    """Passes on the first copy of each event id and quarantines every later copy, with the reason.

    ::

        import apache_beam as beam
        from apache_beam.transforms.window import TimestampedValue
        from runners.direct import local_options
        from transforms import DeduplicateEvents

        events = [{"event_id": "a", "t": 1}, {"event_id": "b", "t": 2}, {"event_id": "a", "t": 3}]
        with beam.Pipeline(options=local_options()) as p:
            timed = p | beam.Create(events) | beam.Map(lambda e: TimestampedValue(e, e["t"]))
            result = timed | DeduplicateEvents(id_field="event_id", ttl=3600)
            result.unique | "Unique" >> beam.Map(print)   # each event id once: a (t=1), b
            result.quarantine | "Quarantined" >> beam.Map(print)   # QuarantinedEvent(event, event_id, reason, ...)

    The result is a ``DeduplicateResult`` named tuple (``.unique``, ``.quarantine``).

    Guarantee: exactly-once per event id within the TTL. A copy whose event time is within ``ttl`` of the first
    copy's, and which arrives before the watermark passes ``first copy + ttl``, is quarantined (never passed on);
    state for an id expires only by event time (an event-time timer), so the guarantee does not depend on wall-clock
    speed or restarts (state and timers are checkpointed by the runner). Which copy is "first" is the first one the
    runner processes, not necessarily the earliest by event time. Events without an id are quarantined, not dropped.
    Counters in namespace ``beamflow.deduplicate``: ``unique``, ``duplicates``, ``missing_id``.

    Bounded input in a batch run (``pcoll.is_bounded`` and not ``--streaming``, windows that do not merge and the
    default trigger): the same guarantee with one ``GroupByKey`` per event id instead of per-key state and timers
    (much cheaper on FnApiRunner, which pays a state-API round trip and a timer per id). There every copy is seen
    at once, so "first" is the earliest copy by event time (ties: lowest Kafka coordinates, so a rerun keeps the
    same copy) and the TTL is applied in event time: a copy at or past ``first + ttl`` starts a new TTL, as it would
    on a stream whose watermark follows event time. Outputs keep each event's own timestamp and window. Unbounded or
    streaming input keeps the stateful path.

    Strategy ``store`` (``table=FirstCopyTable(dsn, table)``; chosen by ``auto`` whenever a table is given): each
    bundle's copies are claimed in one PostgreSQL transaction, keyed by the copy's Kafka coordinates
    (``position_fn``, default ``kafka_position``), so a replayed copy gets the same answer in every attempt. "First"
    is the earliest copy by event time among those not yet recorded; a copy at or past ``first + ttl`` is kept.
    No shuffle, state or timers: the path for streaming jobs on portable runners, where per-key state costs a
    blocking round trip per event, and for bounded runs that continue earlier ones (duplicates across runs are
    caught too). The guarantee holds across restores, upgrades and separate runs that share the table.

    Needs: a keyed stateful ParDo, or on bounded input a GroupByKey (either way a shuffle by event id); or, for
    ``store``, PostgreSQL and events that carry their Kafka coordinates.
    Deduplication is per window: apply it to globally windowed input (before ``WindowInto``) for stream-wide
    deduplication; in fixed windows, copies in different windows are not compared.

    Args:
        id_field: the mapping key that holds the event id (used when ``id_fn`` is not given).
        id_fn: a function event -> id, for events that are not mappings.
        ttl: how long (event time) after the first copy later copies are still recognised.
        strategy: ``auto`` (the default), ``state``, ``grouped`` (refused unless the input is bounded in a batch
            run with non-merging default windows) or ``store`` (needs ``table``). ``auto`` is ``store`` when a
            ``table`` is given, else ``grouped`` for bounded input in a batch run with non-merging windows and the
            default trigger, else ``state``; ``chosen_strategy(events)`` tells which.
        table: the ``store`` strategy's PostgreSQL table (refused with ``state`` or ``grouped``).
        position_fn: event -> (topic, partition, offset), for ``store`` only: given without a ``table`` it has no
            effect, and the constructor warns (``UserWarning``).
    """

    def __init__(
        self,
        id_field: str = "event_id",
        id_fn: Callable[[Any], Hashable | None] | None = None,
        ttl: Duration | int | float = Duration(seconds=24 * 3600),
        label: str | None = None,
        strategy: str = "auto",
        table: FirstCopyTable | None = None,
        position_fn: Callable[[Any], tuple[str, int, int]] = kafka_position,
    ) -> None:
        super().__init__(label)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if strategy == "store" and table is None:
            raise ValueError("strategy 'store' needs table=FirstCopyTable(dsn, table)")
        if table is not None and strategy not in ("auto", "store"):
            raise ValueError(f"table is used only by the store strategy, not {strategy!r}")
        if table is None and position_fn is not kafka_position:
            warnings.warn(
                "DeduplicateEvents: position_fn has no effect without table= (it is used by the store strategy only)",
                UserWarning,
                stacklevel=2,
            )
        self._strategy = "store" if table is not None else strategy
        self._table = table
        self._position_of = position_fn
        self._ttl = ttl if isinstance(ttl, Duration) else Duration.of(ttl)
        if self._ttl <= Duration(0):
            raise ValueError(f"ttl must be positive, got {self._ttl}")
        if id_fn is not None:
            self._id_of: Callable[[Any], Hashable | None] = id_fn
            self._what = "id_fn returned no id"
        else:
            self._id_of = _FieldGetter(id_field)
            self._what = f"field {id_field!r}"

    def chosen_strategy(self, events: beam.PCollection) -> str:
        """The strategy this transform takes on ``events``: ``auto`` resolved by the rule in the docstring."""
        if self._strategy != "auto":
            return self._strategy
        return "grouped" if _can_group(events) else "state"

    def expand(self, events: beam.PCollection) -> DeduplicateResult:
        if self._strategy == "store":
            assert self._table is not None
            first = events | "FirstCopyFromStore" >> beam.ParDo(
                _FirstCopyFromStore(self._table, self._ttl, self._id_of, self._what, self._position_of)
            ).with_outputs(_QUARANTINE, main=_UNIQUE)
            return DeduplicateResult(first[_UNIQUE], first[_QUARANTINE])
        grouped = self.chosen_strategy(events) == "grouped"
        if grouped and not _can_group(events):
            raise ValueError("strategy 'grouped' needs bounded input in a batch run with non-merging default windows")
        keyed = events | "KeyById" >> beam.ParDo(_KeyById(self._id_of, self._what, with_time=grouped)).with_outputs(
            _QUARANTINE, main="keyed"
        )
        if grouped:
            first = (
                keyed.keyed
                | "CopiesPerId" >> beam.GroupByKey()
                | "FirstCopyPerGroup"
                >> beam.ParDo(
                    _FirstCopyPerGroup(self._ttl, global_window=events.windowing.windowfn == GlobalWindows())
                ).with_outputs(_QUARANTINE, main=_UNIQUE)
            )
        else:
            first = keyed.keyed | "FirstCopyPerId" >> beam.ParDo(_FirstCopyPerId(self._ttl)).with_outputs(
                _QUARANTINE, main=_UNIQUE
            )
        quarantine = (keyed[_QUARANTINE], first[_QUARANTINE]) | "Quarantine" >> beam.Flatten()
        return DeduplicateResult(first[_UNIQUE], quarantine)


class _FieldGetter:
    """Picklable ``event[field]`` (a lambda in a transform would not pickle by reference)."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __call__(self, event: Mapping[str, Any]) -> Hashable | None:
        value: Hashable | None = event[self.field]
        return value
