"""``DeduplicateEvents``: drop replayed events by event id, and keep every duplicate in a quarantine output."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.utils.timestamp import Duration, Timestamp

__all__ = ["METRICS_NAMESPACE", "DeduplicateEvents", "DeduplicateResult", "QuarantinedEvent"]

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

    def __init__(self, id_of: Callable[[Any], Hashable | None], what: str) -> None:
        self._id_of = id_of
        self._what = what
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
        yield event_id, event


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


class DeduplicateEvents(beam.PTransform):
    """Passes on the first copy of each event id and quarantines every later copy, with the reason.

    ::

        result = events | DeduplicateEvents(id_field="event_id", ttl=Duration(seconds=3600))
        result.unique      | ...  # each event id once
        result.quarantine  | ...  # QuarantinedEvent(event, event_id, reason, event_time, first_seen)

    The result is a ``DeduplicateResult`` named tuple (``.unique``, ``.quarantine``).

    Guarantee: exactly-once per event id within the TTL. A copy whose event time is within ``ttl`` of the first
    copy's, and which arrives before the watermark passes ``first copy + ttl``, is quarantined (never passed on);
    state for an id expires only by event time (an event-time timer), so the guarantee does not depend on wall-clock
    speed or restarts (state and timers are checkpointed by the runner). Which copy is "first" is the first one the
    runner processes, not necessarily the earliest by event time. Events without an id are quarantined, not dropped.
    Counters in namespace ``beamflow.deduplicate``: ``unique``, ``duplicates``, ``missing_id``.

    Needs: a keyed stateful ParDo (a shuffle by event id). Deduplication is per window: apply it to globally
    windowed input (before ``WindowInto``) for stream-wide deduplication; in fixed windows, copies in different
    windows are not compared.

    Args:
        id_field: the mapping key that holds the event id (used when ``id_fn`` is not given).
        id_fn: a function event -> id, for events that are not mappings.
        ttl: how long (event time) after the first copy later copies are still recognised.
    """

    def __init__(
        self,
        id_field: str = "event_id",
        id_fn: Callable[[Any], Hashable | None] | None = None,
        ttl: Duration | int | float = Duration(seconds=24 * 3600),
        label: str | None = None,
    ) -> None:
        super().__init__(label)
        self._ttl = ttl if isinstance(ttl, Duration) else Duration.of(ttl)
        if self._ttl <= Duration(0):
            raise ValueError(f"ttl must be positive, got {self._ttl}")
        if id_fn is not None:
            self._id_of: Callable[[Any], Hashable | None] = id_fn
            self._what = "id_fn returned no id"
        else:
            self._id_of = _FieldGetter(id_field)
            self._what = f"field {id_field!r}"

    def expand(self, events: beam.PCollection) -> DeduplicateResult:
        keyed = events | "KeyById" >> beam.ParDo(_KeyById(self._id_of, self._what)).with_outputs(
            _QUARANTINE, main="keyed"
        )
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
