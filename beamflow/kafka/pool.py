"""Kafka consumers kept per worker process, for readers whose DoFn instances come and go.

Why: on Beam's portable Flink runner a bundle that asked for finalization keeps its bundle processor (and the DoFn
instances in it) until the next checkpoint completes, so every following bundle of the read builds a fresh processor
and runs ``DoFn.setup`` again. A consumer opened per DoFn instance would then be opened (broker connection, metadata,
assignment) for nearly every bundle; pooled per process, each partition's consumer is opened once.

A pooled consumer nobody checked out for ``idle_close_s`` is closed: the partition moved to another worker, or the
pipeline that read it ended while its process lives on (the DirectRunner, a LOOPBACK worker, a worker pool). Without
that, a long-lived process keeps a broker connection and librdkafka's threads per partition it ever read, reconnecting
forever once that broker is gone.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

from beamflow.kafka.client import KafkaConsumerClient

__all__ = ["PROCESS_POOL", "ConsumerPool"]

IDLE_CLOSE_S = 120.0


class ConsumerPool:
    """Idle consumers by key; a key is checked out by one user at a time (the caller guarantees it, see guard.py).

    ``reap_every_s`` > 0 starts a daemon thread (while the pool holds consumers) that closes the expired ones; with
    0, expired consumers are closed only by ``checkout`` and ``close_idle`` (tests drive those with ``clock``).
    """

    def __init__(
        self,
        idle_close_s: float = IDLE_CLOSE_S,
        clock: Callable[[], float] = time.monotonic,
        reap_every_s: float = IDLE_CLOSE_S / 4,
    ) -> None:
        self.idle_close_s = idle_close_s
        self._clock = clock
        self._reap_every_s = reap_every_s
        self._idle: dict[Hashable, tuple[KafkaConsumerClient, float]] = {}
        self._lock = threading.Lock()
        self._reaper: threading.Thread | None = None

    @contextmanager
    def checkout(
        self, key: Hashable, open_consumer: Callable[[], KafkaConsumerClient]
    ) -> Iterator[KafkaConsumerClient]:
        """The idle consumer for ``key`` (or a new one); back to the pool afterwards, closed if the use failed."""
        self.close_idle()
        with self._lock:
            entry = self._idle.pop(key, None)
        consumer = entry[0] if entry is not None else open_consumer()
        try:
            yield consumer
        except BaseException:
            consumer.close()  # its state (assignment, position) is unknown after a failure
            raise
        with self._lock:
            displaced = self._idle.pop(key, None)
            self._idle[key] = (consumer, self._clock())
            self._start_reaper()
        if displaced is not None:
            displaced[0].close()

    def close_idle(self) -> int:
        """Close the consumers idle for ``idle_close_s`` or longer; how many were closed."""
        deadline = self._clock() - self.idle_close_s
        with self._lock:
            expired = [key for key, (_, since) in self._idle.items() if since <= deadline]
            consumers = [self._idle.pop(key)[0] for key in expired]
        for consumer in consumers:
            consumer.close()
        return len(consumers)

    def close(self) -> None:
        with self._lock:
            entries, self._idle = list(self._idle.values()), {}
        for consumer, _ in entries:
            consumer.close()

    def __len__(self) -> int:
        return len(self._idle)

    def _start_reaper(self) -> None:
        # Called with the lock held. One thread at a time; it ends when the pool is empty and the next return
        # to the pool starts another.
        if self._reap_every_s <= 0 or (self._reaper is not None and self._reaper.is_alive()):
            return
        self._reaper = threading.Thread(target=self._reap, name="beamflow-consumer-pool-reaper", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        while True:
            time.sleep(self._reap_every_s)
            self.close_idle()
            with self._lock:
                if not self._idle:
                    self._reaper = None
                    return


PROCESS_POOL = ConsumerPool()
# Closed before the interpreter exits, so librdkafka's threads do not outlive Python's (and log into closed streams).
atexit.register(PROCESS_POOL.close)
