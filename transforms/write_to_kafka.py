"""``WriteToKafka``: results to a Kafka topic, exactly-once (transactions + a PostgreSQL ledger) or at-least-once.

Signature (kept simple and stable: ``pipelines/rides.py`` builds on it):

    ``WriteToKafka(bootstrap, topic, *, mode="exactly-once" | "at-least-once",
                 sink_group=None, ledger_dsn=None, ledger_table="kafka_sink_ledger", shards=None,
                 producer_config=None, key_fn=None, value_fn=None, id_fn=None, batch_size=1000,
                 max_buffering_s=1.0, ledger_retention_s=7 * 86400, timeout_s=60.0,
                 max_in_flight_bytes=64 * 1024 * 1024)``

Elements are ``beamflow.kafka.producer.ProducerRecord`` or anything ``key_fn``/``value_fn`` turn into key and value
(bytes or str). The engines (no Beam): ``beamflow/kafka/producer.py`` (records, limits, the at-least-once writer) and
``beamflow/kafka/exactly_once.py``, whose module docstring gives the exactly-once design.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.transforms.window import GlobalWindows
from apache_beam.utils.timestamp import MAX_TIMESTAMP, MIN_TIMESTAMP

from beamflow.deadletter import DeadLetter, encode_payload
from beamflow.kafka.exactly_once import ExactlyOnceShardWriter
from beamflow.kafka.ledger import ShardLedger
from beamflow.kafka.producer import (
    AtLeastOnceWriter,
    ProducerRecord,
    build_producer_config,
    check_producer_config,
    fetch_topic_limits,
    shard_of,
    topic_partition_count,
)
from transforms.sink_base import DEAD_LETTERS, Declared, Guarantee, SinkFn, SinkResult, write_with

_MIN_MICROS, _MAX_MICROS = MIN_TIMESTAMP.micros, MAX_TIMESTAMP.micros

__all__ = [
    "DEAD_LETTERS",
    "METRICS_NAMESPACE",
    "MODES",
    "TIMESTAMPS",
    "ProducerRecord",
    "WriteToKafka",
    "close_shared_writers",
]

METRICS_NAMESPACE = "beamflow.kafka_sink"
MODES = ("exactly-once", "at-least-once")
TIMESTAMPS = ("event-time", "producer")
_STAGE = "write_to_kafka"
# Shorter than this, a replay after a restore (or a rerun of a failed bounded job) could come after its ids were
# pruned and be written again.
_MIN_RETENTION_S = 3600.0


# ---- shared shard writers ----------------------------------------------------------------------------------------
# One writer (one transactional producer) per shard per worker process, shared by every DoFn instance: the SDK
# harness keeps a pool of bundle processors and may run one shard's batches on different instances in turn; two
# producers of one transactional id would fence each other on every switch, failing bundles for nothing.

_SHARED: dict[tuple[Any, ...], tuple[ExactlyOnceShardWriter, threading.Lock]] = {}
_LEDGERS: dict[tuple[str, str, float], ShardLedger] = {}
_USERS: dict[tuple[Any, ...], int] = {}
_SHARED_LOCK = threading.Lock()


def _ledger(dsn: str, table: str, retention_s: float, shards: int) -> ShardLedger:
    key = (dsn, table, retention_s)
    with _SHARED_LOCK:
        if key not in _LEDGERS:  # a connection per concurrently written shard, up to 8
            _LEDGERS[key] = ShardLedger(dsn, table, retention_s, connections=min(max(shards, 2), 8))
        return _LEDGERS[key]


def close_shared_writers() -> None:
    """Closes every shared writer and ledger of this process (tests and benchmarks; DoFn teardown does it too)."""
    with _SHARED_LOCK:
        writers = list(_SHARED.values())
        ledgers = list(_LEDGERS.values())
        _SHARED.clear()
        _LEDGERS.clear()
        _USERS.clear()
    for writer, lock in writers:
        with lock:
            writer.close()
    for ledger in ledgers:
        ledger.close()


# ---- elements -> records -------------------------------------------------------------------------------------------


def _as_bytes(value: Any, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"{what} must be bytes, str or None, got {type(value).__name__}")


class _RecordMaker:
    """Element -> (ProducerRecord, its timestamp in ms): the record's own timestamp, else the element's event time
    (None when that is Beam's min or max, or when ``event_time`` is off: the producer stamps the record). Raises on an
    element that cannot become a record: the caller makes it a dead letter. The timestamp travels beside the record,
    so a ``ProducerRecord`` element is written as it is, not copied into a new dataclass per element."""

    def __init__(
        self,
        key_fn: Callable[[Any], Any] | None,
        value_fn: Callable[[Any], Any] | None,
        id_fn: Callable[[Any], Any] | None,
        event_time: bool = True,
    ) -> None:
        self._key_fn = key_fn
        self._value_fn = value_fn
        self._id_fn = id_fn
        self._event_time = event_time

    def __call__(self, element: Any, micros: int) -> tuple[ProducerRecord, int | None]:
        if isinstance(element, ProducerRecord) and self._key_fn is None and self._value_fn is None:
            record = element
            if self._id_fn is not None:
                record = replace(record, record_id=str(self._id_fn(element)))
        else:
            key = _as_bytes(self._key_fn(element), "key_fn's result") if self._key_fn else None
            value = _as_bytes(self._value_fn(element) if self._value_fn else element, "the value")
            record_id = str(self._id_fn(element)) if self._id_fn is not None else None
            record = ProducerRecord(value, key, (), record_id)
        if record.timestamp_ms is not None or not self._event_time:
            return record, record.timestamp_ms
        return record, micros // 1000 if _MIN_MICROS < micros < _MAX_MICROS else None


def _unmakeable(element: Any, exc: Exception) -> DeadLetter:
    return DeadLetter(encode_payload(element), _STAGE, f"cannot make a Kafka record: {exc}", error=type(exc).__name__)


class _ToShardedRecord(beam.DoFn):
    """Element -> (shard, the record as a plain tuple), else a dead letter (exactly-once: records are grouped per shard
    before the writer). Tuples of bytes, str and int cross the shuffle through the fast coder's native path, where a
    dataclass would be pickled one by one (the writer makes records of them again); one step makes and shards them."""

    def __init__(self, make: _RecordMaker, shards: int) -> None:
        self._make = make
        self._shards = shards

    def process(self, element: Any, windowed: Any = beam.DoFn.WindowedValueParam) -> Iterator[Any]:
        try:
            # int micros, not TimestampParam (see SinkFn.process)
            record, timestamp_ms = self._make(element, windowed.timestamp_micros)
        except Exception as exc:  # the element's own fault: it cannot become a record
            yield TaggedOutput(DEAD_LETTERS, _unmakeable(element, exc))
            return
        yield (
            shard_of(record, self._shards),
            (record.value, record.key, record.headers, record.record_id, timestamp_ms),
        )


def _chunks(group: tuple[int, Iterable[Any]], size: int) -> Iterator[tuple[int, list[Any]]]:
    """A shard's grouped records in lists of at most ``size``, read lazily (the group may be large)."""
    shard, records = group
    chunk: list[Any] = []
    for record in records:
        chunk.append(record)
        if len(chunk) >= size:
            yield shard, chunk
            chunk = []
    if chunk:
        yield shard, chunk


# ---- the two sink DoFns ----------------------------------------------------------------------------------------


class _TransactionalFn(SinkFn):
    """Takes (shard, batch) from ``GroupIntoBatches``; each batch is one Kafka transaction of its shard, committed in
    ``process`` (never in a finalizer), with the records' ids recorded in the ledger so a replay is skipped."""

    GUARANTEE = Declared(
        Guarantee.EXACTLY_ONCE,
        "deterministic record ids (id_fn, else key+value+headers), one stable sink_group per sink, shards <= the "
        "topic's partitions, readers with isolation.level=read_committed, replays within the ledger retention",
    )
    STAGE = _STAGE

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        sink_group: str,
        ledger_dsn: str,
        ledger_table: str,
        shards: int,
        producer_config: dict[str, Any],
        retention_s: float,
        timeout_s: float,
        max_in_flight_bytes: int,
    ) -> None:
        super().__init__()
        self._max_in_flight_bytes = max_in_flight_bytes
        self._bootstrap = bootstrap
        self._topic = topic
        self._sink_group = sink_group
        self._ledger_dsn = ledger_dsn
        self._ledger_table = ledger_table
        self._shards = shards
        self._config = producer_config
        self._retention_s = retention_s
        self._timeout_s = timeout_s
        self._written = Metrics.counter(METRICS_NAMESPACE, "records_written")
        self._skipped = Metrics.counter(METRICS_NAMESPACE, "replays_skipped")
        self._dead = Metrics.counter(METRICS_NAMESPACE, "dead_letters")
        self._keys: set[tuple[Any, ...]] = set()

    def open(self) -> None:
        partitions = topic_partition_count(self._bootstrap, self._topic, config=self._config)
        if self._shards > partitions:
            raise ValueError(
                f"WriteToKafka: shards={self._shards} but topic {self._topic} has {partitions} partitions: each "
                "shard's commit marker is an offset on its own partition, so shards must be <= partitions"
            )
        self._partitions = partitions
        config = build_producer_config(self._bootstrap, self._config)
        self._limit = fetch_topic_limits(self._bootstrap, self._topic, config, _STAGE)
        self._ledger = _ledger(self._ledger_dsn, self._ledger_table, self._retention_s, self._shards)
        self._threads: dict[int, ThreadPoolExecutor] = {}
        self._pending: list[tuple[Future[tuple[int, int, int, list[DeadLetter]]], int]] = []
        self._in_flight_bytes = 0

    def _writer(self, shard: int) -> tuple[ExactlyOnceShardWriter, threading.Lock]:
        key = (self._bootstrap, self._topic, self._sink_group, shard, self._ledger_dsn, self._ledger_table)
        with _SHARED_LOCK:
            found = _SHARED.get(key)
            if found is None:
                writer = ExactlyOnceShardWriter(
                    self._bootstrap,
                    self._topic,
                    self._sink_group,
                    shard,
                    self._ledger,
                    self._config,
                    timeout_s=self._timeout_s,
                    stage=_STAGE,
                    limits=self._limit,
                    partitions=self._partitions,
                )
                found = _SHARED[key] = (writer, threading.Lock())
            if key not in self._keys:
                self._keys.add(key)
                _USERS[key] = _USERS.get(key, 0) + 1
        return found

    def add(self, element: tuple[int, Iterable[tuple[Any, ...]]]) -> list[Any]:
        # Shards are written in parallel (one thread per shard, so a shard's batches stay in order): a write mostly
        # waits on PostgreSQL and the broker. Every one has committed before flush returns, i.e. before the bundle
        # ends, as if written here.
        shard, batch = element
        if shard not in self._threads:
            self._threads[shard] = ThreadPoolExecutor(1, thread_name_prefix=f"kafka-shard-{shard}")
        records = [ProducerRecord(*fields) for fields in batch]
        size = sum(len(r.value or b"") + len(r.key or b"") for r in records)
        self._pending.append((self._threads[shard].submit(self._write, shard, records), size))
        self._in_flight_bytes += size
        outputs: list[Any] = []
        # Bounded by bytes, not by batches: bounded input arrives one shard's whole group after another, so a bound
        # of a few batches would leave every shard but the current one idle (the shards written one after another,
        # as slow as one producer). Up to the bound, the next shards' batches start while the first is still written.
        while self._pending and self._in_flight_bytes > self._max_in_flight_bytes:
            future, size = self._pending.pop(0)
            self._in_flight_bytes -= size
            try:
                outputs.extend(self._collect(future))
            except Exception:
                self.flush_quietly()
                raise
        return outputs

    def flush_quietly(self) -> None:
        """Waits for every write in flight, dropping their outcome (the bundle is failing anyway)."""
        pending, self._pending = self._pending, []
        self._in_flight_bytes = 0
        wait([future for future, _ in pending])

    def _write(self, shard: int, batch: list[ProducerRecord]) -> tuple[int, int, int, list[DeadLetter]]:
        writer, lock = self._writer(shard)
        with lock:
            before = writer.stats.skipped_replays
            written, dead = writer.write(batch)
            return shard, written, writer.stats.skipped_replays - before, dead

    def _collect(self, future: Future[tuple[int, int, int, list[DeadLetter]]]) -> list[Any]:
        shard, written, skipped, dead = future.result()
        # Counted here, on the bundle's thread: Beam's metrics are bound to it.
        self._written.inc(written)
        self._skipped.inc(skipped)
        self._dead.inc(len(dead))
        return [*dead, {"topic": self._topic, "shard": shard, "rows_written": written, "replays_skipped": skipped}]

    def flush(self) -> list[Any]:
        pending, self._pending = self._pending, []
        self._in_flight_bytes = 0
        futures = [future for future, _ in pending]
        wait(futures)  # all of them, even after a failure: none may still be writing when the bundle fails
        outputs: list[Any] = []
        for future in futures:
            outputs.extend(self._collect(future))  # raises the first failure: the bundle fails and is retried
        return outputs

    def close(self) -> None:
        # The last DoFn instance of this process using a shard closes its writer.
        closing = []
        with _SHARED_LOCK:
            for key in self._keys:
                _USERS[key] = _USERS.get(key, 1) - 1
                if _USERS[key] <= 0 and key in _SHARED:
                    closing.append(_SHARED.pop(key))
                    del _USERS[key]
            self._keys.clear()
        for writer, lock in closing:
            with lock:
                writer.close()
        for thread in getattr(self, "_threads", {}).values():
            thread.shutdown(wait=True)


class _IdempotentFn(SinkFn):
    """Produces each record; ``flush`` (``finish_bundle``) waits for every ack and fails the bundle on any delivery
    error, so nothing is dropped and the bundle's offsets are not committed before its records are durable."""

    GUARANTEE = Declared(
        Guarantee.AT_LEAST_ONCE,
        "the idempotent producer (no duplicates from its own retries); a replayed bundle is written again",
    )
    STAGE = _STAGE

    def __init__(
        self, bootstrap: str, topic: str, producer_config: dict[str, Any], timeout_s: float, make: _RecordMaker
    ) -> None:
        super().__init__()
        self._make = make
        self._bootstrap = bootstrap
        self._topic = topic
        self._config = producer_config
        self._timeout_s = timeout_s
        self._writer: AtLeastOnceWriter | None = None
        self._written = Metrics.counter(METRICS_NAMESPACE, "records_written")
        self._dead = Metrics.counter(METRICS_NAMESPACE, "dead_letters")

    def open(self) -> None:
        self._writer = AtLeastOnceWriter(self._bootstrap, self._topic, self._config, self._timeout_s, _STAGE)

    def add(self, element: Any) -> Sequence[DeadLetter]:
        # Records are made here, not in a step of their own: one Beam step less per element (benchmarks/kafka_sink).
        assert self._writer is not None
        try:
            record, timestamp_ms = self._make(element, self.element_micros)
        except Exception as exc:  # the element's own fault: it cannot become a record
            return [_unmakeable(element, exc)]  # not in the sink's dead_letters counter, as in exactly-once mode
        dead = self._writer.add(record, timestamp_ms)
        if dead:
            self._dead.inc(len(dead))
        return dead

    def flush(self) -> list[Any]:
        assert self._writer is not None
        count = self._writer.flush()
        self._written.inc(count)
        return [{"topic": self._topic, "rows_written": count}] if count else []

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


# ---- the transform -----------------------------------------------------------------------------------------------


class WriteToKafka(beam.PTransform):
    """Writes records to ``topic``; returns a ``SinkResult``: a report per written batch (``{"topic", "rows_written",
    ...}``) and the ``DeadLetter`` of every element refused (not encodable; too large for the broker: reason
    ``too large for the broker: ...``, error ``MSG_SIZE_TOO_LARGE``; a timestamp the topic refuses or would delete,
    below).

    ::

        import json
        import apache_beam as beam
        from confluent_kafka import Consumer, TopicPartition
        from beamflow.kafka.admin import create_topic
        from runners.direct import local_options
        from transforms import WriteToKafka

        bootstrap, dsn = "127.0.0.1:9092", "postgresql://postgres@127.0.0.1:5432/beamflow"
        create_topic(bootstrap, "example-results", 2)
        results = [{"user": "u1", "clicks": 3}, {"user": "u2", "clicks": 5}, {"user": "u3", "clicks": 1}]
        for run in range(2):  # the second run is a replay: it writes nothing
            with beam.Pipeline(options=local_options()) as p:
                p | beam.Create(results) | WriteToKafka(
                    bootstrap,
                    "example-results",
                    mode="exactly-once",
                    sink_group="example-results-sink",
                    ledger_dsn=dsn,
                    shards=2,
                    key_fn=lambda r: r["user"],
                    value_fn=json.dumps,
                    id_fn=lambda r: r["user"],  # one result per user
                )
        reader = Consumer({"bootstrap.servers": bootstrap, "group.id": "reader", "isolation.level": "read_committed"})
        reader.assign([TopicPartition("example-results", p, 0) for p in range(2)])
        seen = [m.key() for m in iter(lambda: reader.poll(5), None) if not m.error()]
        reader.close()
        assert sorted(seen) == [b"u1", b"u2", b"u3"], seen  # each result exactly once

    ``mode="exactly-once"``: a consumer with ``isolation.level=read_committed`` sees each result (each record id)
    exactly once, through crashes at any moment and replays of any bundle, on Flink and the local runner. Records are
    sharded by a deterministic hash (of the key, else of the record id) into ``shards`` shards, batched per shard
    (unbounded input: ``GroupIntoBatches``, at most ``batch_size`` records, at most ``max_buffering_s`` waiting; bounded
    input: one ``GroupByKey`` per shard, cut into ``batch_size`` lists where they are written), and each batch is one
    Kafka transaction of its shard's producer (``transactional.id = <sink_group>-<shard>``), committed before the
    writer's bundle ends (shards in parallel, one thread each, all joined in ``finish_bundle``), never in a bundle
    finalizer. Before producing, the batch's record ids are checked against and recorded in a PostgreSQL ledger (tables
    ``ledger_table``, ``<ledger_table>_shards``, ``<ledger_table>_attempts``, created if missing): ids already written
    are replays and skipped. A crash between the ledger and the Kafka commit leaves the attempt pending; the next writer
    decides it from a marker committed atomically with the transaction (the sink group's offset on
    ``TopicPartition(topic, shard)``). Zombie writers are fenced by the producer epoch; a fenced writer's bundle fails,
    and its retry starts over (it is not wedged). Why not a transaction per checkpoint (Flink's ``KafkaSink``) or
    committing in a bundle finalizer: librdkafka cannot commit a prepared transaction from another producer instance,
    and Beam's Flink runner finalizes bundles from an in-memory list, so a crash after a checkpoint would lose the
    prepared transaction, or a finalizer would commit a bundle the checkpoint does not cover; and Beam Python 2.62
    cannot request stable input, so Beam Java's sequence numbers would not replay identically. Record ids make the
    replay's order and batching irrelevant.

    It needs (and refuses, with a one-line ``ValueError``, what it can detect): a ``sink_group`` unique to this sink
    and stable across restarts (it names the transactional ids, the markers and the ledger rows; a sink group already
    used for another topic is refused); ``shards`` <= the topic's partitions (the marker of shard ``s`` is an offset
    on partition ``s``, which must exist: refused when the writer opens); a ``ledger_dsn``; deterministic record ids
    (``id_fn``, else a digest of key, value and headers, so two identical results count as one); replays within
    ``ledger_retention_s`` (at least an hour: a result replayed after its id is pruned is written again) and group
    offsets retained longer than any outage (``offsets.retention.minutes``: a pending attempt whose marker expired is
    refused, not guessed); producer settings that keep the guarantee (``transactional.id``, ``acks`` other than
    ``all`` and ``enable.idempotence=false`` are refused). On Flink, results wait in ``GroupIntoBatches`` state for
    at most ``max_buffering_s``: restore jobs from their checkpoints or savepoints (as for every stateful stage);
    keep the checkpoint interval above ``max_buffering_s`` so ``ReadFromKafka``'s offsets (committed one checkpoint
    late) never run ahead of what was written. Readers see results after their transaction commits (about
    ``max_buffering_s``); after a crash mid-transaction, the dead writer's open transaction holds ``read_committed``
    readers of the partitions it wrote back until that shard's next write (whose ``init_transactions`` aborts it) or
    ``transaction.timeout.ms`` (60 s by default), whichever comes first.

    ``mode="at-least-once"``: the idempotent producer (``acks=all``, no duplicates from its own retries); every
    bundle waits in ``finish_bundle`` until its records are acked and fails otherwise, so nothing is dropped; a
    retried or replayed bundle writes its records again. No shuffle, no ledger (``sink_group``, ``ledger_dsn`` and
    ``shards`` are refused).

    Both modes: seed 002's producer defaults (``batch.size`` 128 KB, ``linger.ms`` 75, ``lz4``), every one overridable
    in ``producer_config``; a delivery error (broker down past ``message.timeout.ms``, a topic that does not exist or
    was deleted) fails the bundle (the runner retries it; the local runner fails the pipeline); a record larger than the
    smaller of the producer's ``message.max.bytes`` and the topic's ``max.message.bytes`` goes to ``dead_letters``.
    Timestamps: ``timestamps="event-time"`` (the default) stamps each record with its own ``timestamp_ms``, else the
    element's event time; ``"producer"`` with its own, else the time it is produced (Kafka's default, and Beam Java
    ``KafkaIO``'s unless ``withInputTimestamp``). On a topic that keeps the producer's timestamps (``CreateTime``), a
    record the broker would refuse goes to ``dead_letters`` (error ``INVALID_TIMESTAMP``): stamped more than
    ``message.timestamp.after.max.ms`` ahead (one hour by default) or ``before.max.ms`` behind; the broker refuses the
    whole batch it travels in, so one such record would otherwise fail every retry of its bundle. So does a record
    stamped longer ago than the topic's ``retention.ms`` (error ``TIMESTAMP_BEYOND_RETENTION``): Kafka deletes it as
    soon as its segment closes (at the next append when it is older than ``segment.ms`` too), so a backfill of old
    events must write with ``"producer"`` (or to a topic that keeps them).
    Counters in the ``beamflow.kafka_sink`` metrics namespace: ``records_written``, ``replays_skipped``,
    ``dead_letters``.
    """

    GUARANTEES = {"exactly_once": _TransactionalFn.GUARANTEE, "at_least_once": _IdempotentFn.GUARANTEE}

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        mode: str = "exactly-once",
        sink_group: str | None = None,
        ledger_dsn: str | None = None,
        ledger_table: str = "kafka_sink_ledger",
        shards: int | None = None,
        producer_config: dict[str, Any] | None = None,
        key_fn: Callable[[Any], Any] | None = None,
        value_fn: Callable[[Any], Any] | None = None,
        id_fn: Callable[[Any], Any] | None = None,
        batch_size: int = 1000,
        max_buffering_s: float | None = 1.0,
        ledger_retention_s: float = 7 * 86400,
        timeout_s: float = 60.0,
        max_in_flight_bytes: int = 64 * 1024 * 1024,
        timestamps: str = "event-time",
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"WriteToKafka mode must be one of {', '.join(MODES)}, not {mode!r}")
        if timestamps not in TIMESTAMPS:
            raise ValueError(f"WriteToKafka timestamps must be one of {', '.join(TIMESTAMPS)}, not {timestamps!r}")
        config = dict(producer_config or {})
        check_producer_config(config, exactly_once=mode == "exactly-once")
        if mode == "exactly-once":
            if not sink_group or not ledger_dsn or not shards:
                raise ValueError(
                    "WriteToKafka exactly-once needs sink_group=, ledger_dsn= and shards= (the stable transactional "
                    "ids, the ledger that recognises replays, and how many shard producers)"
                )
            if shards < 1:
                raise ValueError(f"WriteToKafka: shards must be >= 1, not {shards}")
            if ledger_retention_s < _MIN_RETENTION_S:
                raise ValueError(
                    f"WriteToKafka: ledger_retention_s={ledger_retention_s} is under {_MIN_RETENTION_S:.0f}: a replay "
                    "after its ids are pruned would be written again"
                )
            if max_in_flight_bytes < 1:
                raise ValueError("WriteToKafka: max_in_flight_bytes must be >= 1")
            if batch_size < 1 or (max_buffering_s is not None and max_buffering_s <= 0):
                raise ValueError("WriteToKafka: batch_size must be >= 1 and max_buffering_s > 0 (or None)")
        elif sink_group or ledger_dsn or shards:
            raise ValueError(
                "WriteToKafka at-least-once takes no sink_group, ledger_dsn or shards (they belong to exactly-once)"
            )
        self.bootstrap = bootstrap
        self.topic = topic
        self.mode = mode
        self.sink_group = sink_group
        self.ledger_dsn = ledger_dsn
        self.ledger_table = ledger_table
        self.shards = shards
        self.producer_config = config
        self.batch_size = batch_size
        self.max_buffering_s = max_buffering_s
        self.ledger_retention_s = ledger_retention_s
        self.timeout_s = timeout_s
        self.max_in_flight_bytes = max_in_flight_bytes
        self.timestamps = timestamps
        self._make = _RecordMaker(key_fn, value_fn, id_fn, event_time=timestamps == "event-time")
        if mode == "exactly-once":
            from beamflow.postgres.table import validate_identifier

            validate_identifier(ledger_table, "ledger table")  # here, not first on a worker

    def expand(self, elements: beam.PCollection) -> SinkResult:
        if self.mode == "at-least-once":
            # The records are made in the writer itself, so each element takes one Beam step here, not two.
            return write_with(
                elements, _IdempotentFn(self.bootstrap, self.topic, self.producer_config, self.timeout_s, self._make)
            )
        assert self.sink_group and self.ledger_dsn and self.shards
        records = elements | "ToRecords" >> beam.ParDo(_ToShardedRecord(self._make, self.shards)).with_output_types(
            tuple[int, Any]
        ).with_outputs(DEAD_LETTERS, main="records")
        # One place per shard: the grouping is keyed, so a shard's batches all come from the one worker that owns its
        # key, and the writer (fused after it) commits each before the bundle ends. In the global window: groups are
        # per window, and event-time windows would cut them into tiny transactions.
        sharded = records.records
        if not isinstance(elements.windowing.windowfn, GlobalWindows):
            sharded = sharded | "GlobalWindow" >> beam.WindowInto(GlobalWindows())
        if elements.is_bounded:
            # Bounded input ends: one group per shard at the end, cut into transactions of batch_size where it is
            # written. GroupIntoBatches would keep every element in state on the way (a state call per element: twice
            # the time on the local runner).
            batches = sharded | "GroupByShard" >> beam.GroupByKey() | "Chunk" >> beam.FlatMap(_chunks, self.batch_size)
        else:
            batches = sharded | "Batch" >> beam.GroupIntoBatches(
                self.batch_size, max_buffering_duration_secs=self.max_buffering_s
            )
        written = write_with(
            batches,
            _TransactionalFn(
                self.bootstrap,
                self.topic,
                self.sink_group,
                self.ledger_dsn,
                self.ledger_table,
                self.shards,
                self.producer_config,
                self.ledger_retention_s,
                self.timeout_s,
                self.max_in_flight_bytes,
            ),
        )
        dead = (records[DEAD_LETTERS], written.dead_letters) | "DeadLetters" >> beam.Flatten()
        return SinkResult(written=written.written, dead_letters=dead)
