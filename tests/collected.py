"""Collect a PCollection's elements in the test process: the pinned local runners run pipelines in this process."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import apache_beam as beam

__all__ = ["collect", "collected"]

_COLLECTED: dict[str, list[Any]] = {}


class _Collect(beam.DoFn):
    def __init__(self, token: str, with_time: bool) -> None:
        self.token = token
        self.with_time = with_time

    def process(
        self, element: Any, timestamp: Any = beam.DoFn.TimestampParam, window: Any = beam.DoFn.WindowParam
    ) -> Iterator[Any]:
        _COLLECTED.setdefault(self.token, []).append((element, timestamp, window) if self.with_time else element)
        return iter(())


def collect(pcoll: beam.PCollection, name: str, with_time: bool = False) -> str:
    """Adds a step that keeps ``pcoll``'s elements (with timestamp and window if asked); returns their token."""
    token = f"{name}-{uuid.uuid4().hex}"
    _COLLECTED[token] = []
    pcoll | f"Collect{name}" >> beam.ParDo(_Collect(token, with_time))
    return token


def collected(token: str) -> list[Any]:
    """What the step of ``token`` kept (once the pipeline ran); forgets it."""
    return _COLLECTED.pop(token)
