"""Producing records to Kafka: the records, the producer settings both delivery modes rest on, the topic's limits
checked before producing, and the at-least-once writer (the idempotent producer). No Beam.

The exactly-once writer (``beamflow.kafka.exactly_once``) builds on these; its module docstring gives the design.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from beamflow.deadletter import DeadLetter
from beamflow.kafka.admin import connection_config, topic_partition_count

__all__ = [
    "DEFAULT_PRODUCER_CONFIG",
    "FAILED_REPORTS_ONLY",
    "AtLeastOnceWriter",
    "KafkaWriteError",
    "ProducerRecord",
    "RecordTooLarge",
    "ShardFenced",
    "TopicLimits",
    "build_producer_config",
    "check_producer_config",
    "connection_config",
    "fetch_topic_limits",
    "produce_record",
    "record_size",
    "shard_of",
    "topic_config",
    "topic_limits",
    "topic_partition_count",
]

log = logging.getLogger(__name__)

# Seed 002's producer settings: 128 KB batches, 50-100 ms linger, lz4. Every one can be overridden.
DEFAULT_PRODUCER_CONFIG: dict[str, Any] = {
    "batch.size": 128 * 1024,
    "linger.ms": 75,
    "compression.type": "lz4",
    "acks": "all",
    "enable.idempotence": True,
}
# What both modes' guarantees rest on: set here, and refused (not silently replaced) when producer_config differs.
_FIXED = {"acks": "all", "enable.idempotence": True}
# Delivery reports for failed records only: confluent-kafka then skips building a Message and calling Python for
# every acked record (its Producer.c checks this setting itself, so no per-record state leaks). Nothing here counts
# successes by report: a flush with no error and nothing left queued means every record was acked, and a
# transaction's commit fails on any delivery error anyway.
FAILED_REPORTS_ONLY = {"delivery.report.only.error": True}
# Bytes a record costs beyond key, value and headers in a v2 record batch (varints, attributes, the batch header when
# it travels alone): kept conservative so a record judged to fit does fit.
_RECORD_OVERHEAD = 128


class KafkaWriteError(RuntimeError):
    """Kafka did not take the records (delivery errors, an aborted or fenced transaction): the bundle must fail."""


class ShardFenced(KafkaWriteError):
    """Another writer instance took over this shard (this one is a zombie, or was until its retry)."""


def check_producer_config(config: dict[str, Any], exactly_once: bool) -> None:
    """Raises ValueError (one line, saying why) for producer settings under which the mode's guarantee cannot hold."""
    if "transactional.id" in config:
        raise ValueError(
            "producer_config sets transactional.id: the sink derives it from sink_group and shard "
            "(a random or shared id would leave zombies unfenced)"
        )
    if str(config.get("enable.idempotence", True)).lower() not in ("true", "1"):
        raise ValueError("producer_config disables enable.idempotence: retries inside the producer would duplicate")
    if str(config.get("acks", "all")).lower() not in ("all", "-1"):
        raise ValueError(f"producer_config sets acks={config['acks']}: a record acked by one replica may be lost")
    if exactly_once and "isolation.level" in config:
        raise ValueError("producer_config sets isolation.level, a consumer setting: readers set read_committed")


@dataclass(slots=True)
class ProducerRecord:
    """One record to write. ``record_id`` identifies the result across replays (exactly-once skips ids already
    written); None means a digest of key, value and headers, so identical results count as one.

    Treat it as a value: it is not frozen because a job makes one per result, and a frozen dataclass's ``__init__``
    (``object.__setattr__`` per field) cost 1.35 us a record against 0.30 for this slotted one
    (``benchmarks/kafka_sink.py``'s profile: 11% of an at-least-once run's Python time)."""

    value: bytes | None
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    record_id: str | None = None
    timestamp_ms: int | None = None

    def identity(self) -> str:
        if self.record_id is not None:
            return self.record_id
        digest = hashlib.blake2b(digest_size=16)
        for part in (self.key, self.value):
            digest.update(b"\x00" if part is None else b"\x01" + len(part).to_bytes(8, "big") + part)
        for name, value in self.headers:
            digest.update(name.encode() + b"\x00" + len(value).to_bytes(8, "big") + value)
        return digest.hexdigest()


def record_size(record: ProducerRecord) -> int:
    headers = sum(len(k) + len(v) + 8 for k, v in record.headers) if record.headers else 0
    return len(record.key or b"") + len(record.value or b"") + headers + _RECORD_OVERHEAD


def shard_of(record: ProducerRecord, shards: int) -> int:
    """The shard of a record: by key (so one key's records stay in order in one shard), else by its id."""
    basis = record.key if record.key is not None else record.identity().encode()
    return int.from_bytes(hashlib.blake2b(basis, digest_size=8).digest(), "big") % shards


def topic_config(
    bootstrap: str, topic: str, timeout_s: float = 30.0, config: dict[str, Any] | None = None
) -> dict[str, str]:
    """The topic's configuration (name -> value as the broker reports it); raises for a missing topic."""
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient(connection_config(bootstrap, config))
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)])
    for future in futures.values():
        try:
            entries = future.result(timeout_s)
        except Exception as exc:
            raise KafkaWriteError(f"topic {topic}: cannot read its configuration ({exc})") from exc
        return {name: entry.value for name, entry in entries.items()}
    raise KafkaWriteError(f"no configuration for topic {topic}")


@dataclass
class WriterStats:
    written: int = 0
    skipped_replays: int = 0
    transactions: int = 0
    dead_letters: int = 0
    recovered_committed: int = 0
    recovered_aborted: int = 0
    fenced: int = 0


_LONG_MAX = 2**63 - 1


@dataclass
class TopicLimits:
    """What the topic refuses or loses, checked before producing: such records go to dead letters with the reason.

    - Records larger than ``max_bytes`` (about: see ``record_size``): the broker refuses them.
    - With ``CreateTime`` timestamps, a record stamped more than ``after_max_ms`` ahead of now, or more than
      ``before_max_ms`` before it (``message.timestamp.after.max.ms``, one hour by default in Kafka 4, and
      ``.before.max.ms``): the broker refuses the **whole batch** it travels in (``INVALID_TIMESTAMP``), so one such
      record would fail every retry of its bundle and stop the job.
    - With ``CreateTime`` and ``cleanup.policy`` ``delete``, a record stamped more than ``retention_ms`` ago: Kafka
      deletes a closed segment whose newest timestamp is past the retention, so such a record lives only until its
      segment closes, and a segment whose first record is older than ``segment.ms`` closes at the next append (the
      deletion follows at the next retention check, ``log.retention.check.interval.ms``, five minutes). A backfill
      that writes results stamped with old event times would lose them, silently.

    Records without a timestamp (the producer stamps them with the current time) only have their size checked.
    """

    max_bytes: int
    stage: str
    before_max_ms: int | None = None
    after_max_ms: int | None = None
    retention_ms: int | None = None
    clock: Callable[[], float] = field(default=time.time, repr=False)

    def split(self, records: Iterable[ProducerRecord]) -> tuple[list[ProducerRecord], list[DeadLetter]]:
        fit: list[ProducerRecord] = []
        dead: list[DeadLetter] = []
        now_ms = int(self.clock() * 1000)
        for record in records:
            refused = self.refuse(record, record.timestamp_ms, now_ms)
            if refused is None:
                fit.append(record)
            else:
                dead.append(refused)
        return fit, dead

    def refuse(self, record: ProducerRecord, timestamp_ms: int | None, now_ms: int | None = None) -> DeadLetter | None:
        """The dead letter of ``record`` (to be stamped ``timestamp_ms``) if the topic would refuse or lose it."""
        size = record_size(record)
        if size > self.max_bytes:
            return self.exceeds(record, size)
        if timestamp_ms is None:
            return None
        now_ms = int(self.clock() * 1000) if now_ms is None else now_ms
        age_ms = now_ms - timestamp_ms
        if self.after_max_ms is not None and -age_ms > self.after_max_ms:
            return self._dead(
                record,
                f"timestamp {timestamp_ms} is {-age_ms} ms ahead of now; the broker refuses more than "
                f"{self.after_max_ms} ms (message.timestamp.after.max.ms), and with it the whole batch",
                "INVALID_TIMESTAMP",
            )
        if self.before_max_ms is not None and age_ms > self.before_max_ms:
            return self._dead(
                record,
                f"timestamp {timestamp_ms} is {age_ms} ms old; the broker refuses more than {self.before_max_ms} ms "
                "(message.timestamp.before.max.ms), and with it the whole batch",
                "INVALID_TIMESTAMP",
            )
        if self.retention_ms is not None and age_ms > self.retention_ms:
            return self._dead(
                record,
                f"timestamp {timestamp_ms} is {age_ms} ms old, beyond the topic's retention.ms {self.retention_ms}: "
                "Kafka deletes it once its segment closes; write with timestamps='producer' or raise the retention",
                "TIMESTAMP_BEYOND_RETENTION",
            )
        return None

    def exceeds(self, record: ProducerRecord, size: int) -> DeadLetter:
        return self.too_large(record, f"record of about {size} bytes exceeds {self.max_bytes}")

    def too_large(self, record: ProducerRecord, why: str) -> DeadLetter:
        return self._dead(record, f"too large for the broker: {why}", "MSG_SIZE_TOO_LARGE")

    def _dead(self, record: ProducerRecord, reason: str, error: str) -> DeadLetter:
        return DeadLetter(
            record.value or b"",
            self.stage,
            reason,
            key=record.key,
            error=error,
            attributes=(("record_id", record.identity()),),
        )


def build_producer_config(bootstrap: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Seed 002's defaults, then ``overrides``, then what the guarantees rest on (already checked to agree); secret
    references resolved (call where the producer is made)."""
    from beamflow.secrets import kafka_client_config

    return kafka_client_config(
        {"bootstrap.servers": bootstrap, **DEFAULT_PRODUCER_CONFIG, **FAILED_REPORTS_ONLY, **overrides, **_FIXED}
    )


def fetch_topic_limits(bootstrap: str, topic: str, config: dict[str, Any], stage: str) -> TopicLimits:
    """The topic's limits, read from the broker (``topic_limits``)."""
    return topic_limits(topic_config(bootstrap, topic, config=config), config, stage)


def topic_limits(settings: Mapping[str, str], config: Mapping[str, Any], stage: str) -> TopicLimits:
    """``TopicLimits`` of a topic's configuration (``topic_config``): the smaller of the client's ``message.max.bytes``
    and the topic's ``max.message.bytes``; its timestamp rules when the topic keeps the producer's timestamps
    (``CreateTime``)."""
    limits = TopicLimits(
        min(int(config.get("message.max.bytes", 1_000_000)), int(settings["max.message.bytes"])), stage
    )
    if settings.get("message.timestamp.type", "CreateTime") != "CreateTime":
        return limits  # LogAppendTime: the broker stamps every record itself
    for name, attribute in (
        ("message.timestamp.before.max.ms", "before_max_ms"),
        ("message.timestamp.after.max.ms", "after_max_ms"),
    ):
        value = int(settings.get(name) or _LONG_MAX)
        if 0 <= value < _LONG_MAX:
            setattr(limits, attribute, value)
    retention = int(settings.get("retention.ms") or -1)
    if retention >= 0 and "delete" in settings.get("cleanup.policy", "delete"):
        limits.retention_ms = retention
    return limits


class AtLeastOnceWriter:
    """The idempotent producer: no duplicates from the producer's own retries; a replayed bundle writes again.

    ``add`` produces (records too large come back as dead letters); ``flush`` waits until every record is acked and
    raises ``KafkaWriteError`` on any delivery error, so the bundle fails and the runner retries it.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        producer_config: dict[str, Any] | None = None,
        flush_timeout_s: float = 120.0,
        stage: str = "write_to_kafka",
    ) -> None:
        from confluent_kafka import Producer

        overrides = dict(producer_config or {})
        check_producer_config(overrides, exactly_once=False)
        self.topic = topic
        config = build_producer_config(bootstrap, overrides)
        self.limit = fetch_topic_limits(bootstrap, topic, config, stage)
        self.flush_timeout_s = flush_timeout_s
        self.stats = WriterStats()
        self._errors: list[str] = []
        self._pending = 0
        self._producer = Producer(config)
        self._on_delivery = self._delivered  # bound once: ``add`` runs per record

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self._errors.append(str(err))

    def add(self, record: ProducerRecord, timestamp_ms: int | None = None) -> Sequence[DeadLetter]:
        """Produces ``record``, stamped ``timestamp_ms`` if given (else its own ``timestamp_ms``); a record the topic
        would refuse or lose (``TopicLimits``) comes back as a dead letter instead."""
        timestamp_ms = timestamp_ms or record.timestamp_ms
        value, key = record.value, record.key
        # Per record, so the common case (no headers, no timestamp to check, clearly small enough) skips the full
        # check's calls; ``refuse`` decides everything else.
        if (
            record.headers
            or timestamp_ms is not None
            or (len(value) if value else 0) + (len(key) if key else 0) + _RECORD_OVERHEAD > self.limit.max_bytes
        ):
            refused = self.limit.refuse(record, timestamp_ms)
            if refused is not None:
                self.stats.dead_letters += 1
                return [refused]
        try:
            produce_record(self._producer, self.topic, record, self._on_delivery, timestamp_ms)
        except RecordTooLarge as exc:
            self.stats.dead_letters += 1
            return [self.limit.too_large(record, str(exc))]
        self._pending += 1
        return ()

    def flush(self) -> int:
        """Waits for every ack; returns how many records this flush covered."""
        remaining = self._producer.flush(self.flush_timeout_s)
        count, self._pending = self._pending, 0
        if remaining or self._errors:
            errors, self._errors = self._errors, []
            raise KafkaWriteError(
                f"topic {self.topic}: {remaining} records unacked (waited up to {self.flush_timeout_s:.0f}s), "
                f"{len(errors)} delivery errors: {errors[:3]}"
            )
        self.stats.written += count
        return count

    def close(self) -> None:
        # Records still queued belong to a bundle that did not finish (flush raised or never ran): the runner
        # replays them, so they are dropped rather than waited for.
        with contextlib.suppress(Exception):
            self._producer.purge()
        self._producer.close()


class RecordTooLarge(Exception):
    """The producer refused a record as too large for its own ``message.max.bytes`` (the record's fault)."""


def produce_record(
    producer: Any,
    topic: str,
    record: ProducerRecord,
    on_delivery: Callable[[Any, Any], None],
    timestamp_ms: int | None = None,
) -> None:
    """Produces ``record``; retries while the local queue is full; raises ``RecordTooLarge`` for a record too large."""
    # Called once per record: positional arguments and no keyword dict when there are no headers (the common case).
    headers = list(record.headers) if record.headers else None
    timestamp = timestamp_ms or record.timestamp_ms or 0  # 0: librdkafka stamps the record itself
    while True:
        try:
            producer.produce(
                topic, record.value, record.key, on_delivery=on_delivery, timestamp=timestamp, headers=headers
            )
            return
        except BufferError:  # the local queue is full: let deliveries drain
            producer.poll(0.1)
        except Exception as exc:
            from confluent_kafka import KafkaError

            error: Any = exc.args[0] if exc.args else None
            if isinstance(error, KafkaError) and error.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                raise RecordTooLarge(error.str()) from exc
            raise
