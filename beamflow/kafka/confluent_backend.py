"""The librdkafka backend (confluent-kafka): the fast one.

Tuned from measurements on this kind of machine (``benchmarks/kafka_read.py``): with the default
``fetch.queue.backoff.ms`` (1 s) librdkafka pauses between fetches and tops out near 150k msg/s; with a short
``fetch.wait.max.ms`` and a backoff of a few ms the same consumer reads several times faster. Not 0: the backoff is
how long librdkafka waits before asking again when a partition's prefetch queue is full, and with 0 it asks again at
once, so every consumer on a backlog larger than its queue spins a core (four consumers on a 400,000-record topic:
15.7 CPU s in 8 idle seconds with 0, 0.09 s with 5 ms, the same read speed). The queue is bounded (20,000 records,
16 MB, 1 MB fetches per partition): with 100,000 records, 64 MB and 4 MB fetches each consumer held a whole test
topic in memory (174 MB for four consumers on 400,000 records against 83 MB), for no read speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as CkTopicPartition

from beamflow.kafka.client import KafkaConsumerClient
from beamflow.kafka.record import KafkaRecord, TopicPartition

__all__ = ["TUNED_DEFAULTS", "ConfluentConsumer"]

T = TypeVar("T")

TUNED_DEFAULTS: dict[str, Any] = {
    "fetch.queue.backoff.ms": 5,
    "fetch.wait.max.ms": 10,
    "queued.min.messages": 20000,
    "queued.max.messages.kbytes": 16384,
    "fetch.max.bytes": 8388608,
    "max.partition.fetch.bytes": 1048576,
}


# Group-coordinator errors a broker answers while it (re)loads the offsets topic: after a start, a restart or a
# coordinator move. They clear within seconds; anything else is raised at once.
_COORDINATOR_RETRIABLE = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError._WAIT_COORD,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
    }
)


def _retry_coordinator(call: Callable[[], T], attempts: int = 20) -> T:
    for attempt in range(attempts):
        try:
            return call()
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            code = error.code() if isinstance(error, KafkaError) else None
            if code not in _COORDINATOR_RETRIABLE or attempt == attempts - 1:
                raise
            time.sleep(min(2.0, 0.1 * 2**attempt))
    raise AssertionError("unreachable")


class ConfluentConsumer(KafkaConsumerClient):
    def __init__(self, bootstrap: str, group_id: str, config: Mapping[str, Any]) -> None:
        settings: dict[str, Any] = {
            **TUNED_DEFAULTS,
            **config,
            "bootstrap.servers": bootstrap,
            "group.id": group_id,
            # Offsets move only through commit() from a bundle finalizer; never behind beamflow's back.
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
        }
        settings.setdefault("auto.offset.reset", "earliest")
        self._consumer = Consumer(settings)
        # The assignment: next offset poll() returns per partition (where it was assigned, then last returned + 1).
        self._position: dict[TopicPartition, int] = {}

    def assign(self, tp: TopicPartition, offset: int) -> None:
        if self._position.get(tp) == offset:
            # Already reading there: re-assigning would drop librdkafka's prefetched records and fetch them again
            # (the read transform re-assigns at the start of every bundle, at the offset where the last one ended).
            return
        self._position[tp] = offset
        # Other partitions of this consumer stay where they are (their current position, not where they started).
        self._consumer.assign([CkTopicPartition(t.topic, t.partition, o) for t, o in self._position.items()])

    def poll(self, max_records: int, timeout_s: float) -> list[KafkaRecord]:
        out: list[KafkaRecord] = []
        append = out.append
        record = KafkaRecord
        consumer = self._consumer
        # What librdkafka already fetched, without waiting; only if that is nothing, wait (up to timeout_s) for the
        # first record and take what has arrived with it. consume(n, timeout) alone would wait until n records
        # arrived, so a partition with fewer than n left would cost the full timeout on every poll.
        messages = consumer.consume(num_messages=max_records, timeout=0)
        if not messages:
            messages = consumer.consume(num_messages=1, timeout=timeout_s)
            if messages and max_records > 1:
                messages.extend(consumer.consume(num_messages=max_records - 1, timeout=0))
        for msg in messages:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(err)
            headers = msg.headers()
            append(
                record(
                    msg.topic(),  # type: ignore[arg-type]  # set on every non-error message
                    msg.partition(),  # type: ignore[arg-type]
                    msg.offset(),  # type: ignore[arg-type]
                    msg.timestamp()[1],
                    msg.key(),
                    msg.value(),
                    tuple(headers) if headers else (),  # type: ignore[arg-type]
                )
            )
        if out:
            # One consumer usually reads one partition; record the position of each partition seen.
            for rec in out if len(self._position) > 1 else out[-1:]:
                self._position[TopicPartition(rec.topic, rec.partition)] = rec.offset + 1
        return out

    def watermarks(self, tp: TopicPartition, timeout_s: float = 10.0) -> tuple[int, int]:
        low, high = self._consumer.get_watermark_offsets(
            CkTopicPartition(tp.topic, tp.partition), timeout=timeout_s, cached=False
        )
        return int(low), int(high)

    def committed(self, tp: TopicPartition, timeout_s: float = 10.0) -> int | None:
        [result] = _retry_coordinator(
            lambda: self._consumer.committed([CkTopicPartition(tp.topic, tp.partition)], timeout=timeout_s)
        )
        return None if result.offset in (OFFSET_INVALID, -1) else int(result.offset)

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        _retry_coordinator(
            lambda: self._consumer.commit(
                offsets=[CkTopicPartition(tp.topic, tp.partition, off) for tp, off in offsets.items()],
                asynchronous=False,
            )
        )

    def offset_for_time(self, tp: TopicPartition, timestamp_ms: int, timeout_s: float = 10.0) -> int | None:
        [result] = self._consumer.offsets_for_times(
            [CkTopicPartition(tp.topic, tp.partition, timestamp_ms)], timeout=timeout_s
        )
        return None if result.offset < 0 else int(result.offset)

    def partitions(self, topic: str, timeout_s: float = 10.0) -> list[int]:
        metadata = self._consumer.list_topics(topic, timeout=timeout_s)
        described = metadata.topics.get(topic)
        if described is None or described.error is not None:
            raise KafkaException(described.error if described else f"topic {topic} not found")
        return sorted(described.partitions)

    def close(self) -> None:
        self._consumer.close()
