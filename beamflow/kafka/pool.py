"""Kafka consumers kept per worker process, for readers whose DoFn instances come and go.

Why: on Beam's portable Flink runner a bundle that asked for finalization keeps its bundle processor (and the DoFn
instances in it) until the next checkpoint completes, so every following bundle of the read builds a fresh processor
and runs ``DoFn.setup`` again. A consumer opened per DoFn instance would then be opened (broker connection, metadata,
assignment) for nearly every bundle; pooled per process, each partition's consumer is opened once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

from beamflow.kafka.client import KafkaConsumerClient

__all__ = ["PROCESS_POOL", "ConsumerPool"]


class ConsumerPool:
    """Idle consumers by key; a key is checked out by one user at a time (the caller guarantees it, see guard.py)."""

    def __init__(self) -> None:
        self._idle: dict[Hashable, KafkaConsumerClient] = {}
        self._lock = threading.Lock()

    @contextmanager
    def checkout(
        self, key: Hashable, open_consumer: Callable[[], KafkaConsumerClient]
    ) -> Iterator[KafkaConsumerClient]:
        """The idle consumer for ``key`` (or a new one); back to the pool afterwards, closed if the use failed."""
        with self._lock:
            consumer = self._idle.pop(key, None)
        if consumer is None:
            consumer = open_consumer()
        try:
            yield consumer
        except BaseException:
            consumer.close()  # its state (assignment, position) is unknown after a failure
            raise
        with self._lock:
            displaced = self._idle.pop(key, None)
            self._idle[key] = consumer
        if displaced is not None:
            displaced.close()

    def close(self) -> None:
        with self._lock:
            consumers, self._idle = list(self._idle.values()), {}
        for consumer in consumers:
            consumer.close()

    def __len__(self) -> int:
        return len(self._idle)


PROCESS_POOL = ConsumerPool()
