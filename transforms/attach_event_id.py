"""``AttachEventId``: a deterministic event id on each element; elements without what the id is made of go to dead
letters.

Guarantee: deterministic: the same input always gets the same id, in any process, machine or Python version, so
downstream deduplication and idempotent sinks can rely on it. Nothing is dropped: an element missing an identifying
field (or a Kafka coordinate) comes out of ``dead_letters`` with the reason.

Example::

    import apache_beam as beam
    from runners.direct import local_options
    from transforms import AttachEventId

    with beam.Pipeline(options=local_options()) as p:
        rows = p | beam.Create([{"user_id": "u1", "ad_id": "a1", "event_time": 1}, {"user_id": "u2"}])
        result = rows | AttachEventId(fields=["user_id", "ad_id", "event_time"])
        result.events | beam.Map(print)                                # adds "event_id"
        result.dead_letters | beam.Map(lambda d: print(d.reason))      # the row without ad_id and event_time
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput

from beamflow.deadletter import DeadLetter, encode_payload
from beamflow.event_id import event_id_from_coordinates, event_id_from_fields
from beamflow.kafka.record import KafkaRecord
from transforms.sink_base import DEAD_LETTERS

__all__ = ["AttachEventId", "EventIdResult"]

_STAGE = "attach_event_id"


class EventIdResult(NamedTuple):
    """``events``: the elements with their id; ``dead_letters``: ``DeadLetter`` of elements that have none."""

    events: beam.PCollection
    dead_letters: beam.PCollection


class _AttachFn(beam.DoFn):
    def __init__(self, fields: list[str] | None, id_field: str) -> None:
        self._fields = fields
        self._id_field = id_field
        self._missing = Metrics.counter("beamflow.event_id", "missing_identifying_field")

    def _id(self, element: Any) -> str:
        if self._fields:
            return event_id_from_fields(element, self._fields)
        if isinstance(element, KafkaRecord):
            return event_id_from_coordinates(element.topic, element.partition, element.offset)
        coords = element.get("_kafka", element)
        try:
            return event_id_from_coordinates(coords["topic"], coords["partition"], coords["offset"])
        except KeyError as exc:
            raise KeyError(f"no Kafka coordinates in element to derive an event id from: missing {exc}") from None

    def process(self, element: Any) -> Iterator[Any]:
        try:
            event_id = self._id(element)
        except KeyError as exc:
            self._missing.inc()
            yield TaggedOutput(DEAD_LETTERS, _dead_letter(element, str(exc.args[0]), "MissingField"))
            return
        except (AttributeError, TypeError) as exc:  # not a mapping at all
            self._missing.inc()
            yield TaggedOutput(DEAD_LETTERS, _dead_letter(element, f"cannot derive an event id: {exc}", "NotAMapping"))
            return
        if isinstance(element, KafkaRecord):
            yield (event_id, element)
        else:
            yield {**element, self._id_field: event_id}


def _dead_letter(element: Any, reason: str, error: str) -> DeadLetter:
    coords = element.get("_kafka", element) if isinstance(element, Mapping) else {}
    coords = coords if isinstance(coords, Mapping) else {}
    topic, partition, offset = coords.get("topic"), coords.get("partition"), coords.get("offset")
    return DeadLetter(
        encode_payload(element),
        _STAGE,
        reason,
        topic=topic if isinstance(topic, str) else None,
        partition=partition if isinstance(partition, int) else None,
        offset=offset if isinstance(offset, int) else None,
        error=error,
    )


class AttachEventId(beam.PTransform):
    """Adds ``id_field`` (default ``event_id``) to dict elements; returns an ``EventIdResult(events, dead_letters)``.

    With ``fields`` the id hashes those payload fields; without, it hashes the Kafka coordinates found in the element
    (``KafkaRecord`` attributes, or ``topic``/``partition``/``offset`` keys, or a ``_kafka`` sub-dict). ``KafkaRecord``
    elements become ``(event_id, record)`` pairs. An element missing one of ``fields`` (or a coordinate) is not
    passed on: its ``DeadLetter`` (stage ``attach_event_id``, error ``MissingField``) names the missing field, and
    the counter ``beamflow.event_id/missing_identifying_field`` counts it.
    """

    def __init__(self, fields: Sequence[str] | None = None, id_field: str = "event_id") -> None:
        super().__init__()
        self._fields = list(fields) if fields else None
        self._id_field = id_field

    def expand(self, pcoll: beam.PCollection) -> EventIdResult:
        outputs = pcoll | "AttachEventId" >> beam.ParDo(_AttachFn(self._fields, self._id_field)).with_outputs(
            DEAD_LETTERS, main="events"
        )
        return EventIdResult(outputs.events, outputs[DEAD_LETTERS])
