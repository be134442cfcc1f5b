"""Attach a deterministic event id to each element.

Guarantee: deterministic: the same input always gets the same id, in any process, machine or Python version, so
downstream deduplication and idempotent sinks can rely on it.

Example::

    import apache_beam as beam
    from transforms.attach_event_id import AttachEventId

    with beam.Pipeline() as p:
        rows = p | beam.Create([{"user_id": "u1", "ad_id": "a1", "event_time": 1}])
        rows | AttachEventId(fields=["user_id", "ad_id", "event_time"])  # adds "event_id"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import apache_beam as beam

from beamflow.event_id import event_id_from_coordinates, event_id_from_fields
from beamflow.kafka.record import KafkaRecord

__all__ = ["AttachEventId"]


class AttachEventId(beam.PTransform):
    """Adds ``id_field`` (default ``event_id``) to dict elements.

    With ``fields`` the id hashes those payload fields; without, it hashes the Kafka coordinates found in the element
    (``KafkaRecord`` attributes, or ``topic``/``partition``/``offset`` keys, or a ``_kafka`` sub-dict). ``KafkaRecord``
    elements become ``(event_id, record)`` pairs.
    """

    def __init__(self, fields: Sequence[str] | None = None, id_field: str = "event_id") -> None:
        super().__init__()
        self._fields = list(fields) if fields else None
        self._id_field = id_field

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

    def _attach(self, element: Any) -> Any:
        if isinstance(element, KafkaRecord):
            return (self._id(element), element)
        return {**element, self._id_field: self._id(element)}

    def expand(self, pcoll: beam.PCollection) -> beam.PCollection:
        return pcoll | "AttachEventId" >> beam.Map(self._attach)
