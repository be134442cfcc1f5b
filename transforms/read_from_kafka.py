"""Read Kafka with a splittable DoFn, committing offsets only after the runner made the output durable.

Guarantee: **at-least-once delivery into the pipeline, exactly-once in effect with the runner's checkpoints**. Each
topic-partition is one restriction whose start offset is resolved once, when the restriction is created (the group's
committed offset, else the ``start`` policy); from then on the restriction in the runner's checkpoint is the truth for
where to resume, not Kafka's group offset. Offsets are committed to the group only from the bundle finalizer, only
forward, never by auto-commit: a failure before finalization leaves them where they were, and a rerun resumes from
them. A streaming read commits one finalization round late: on Flink a round is a completed checkpoint, and Beam's
Flink runner also finalizes bundles that ran after that checkpoint's barrier, whose records the sinks may not hold yet
(``beamflow.kafka.commits.RoundDelayedCommits``). With sinks that commit per bundle (all of beamflow's) and
``finish_bundle_before_checkpointing``, the group's offsets then never run ahead of what the sinks hold. Pair it
with the idempotent or exactly-once sinks so replays after a failure leave no duplicates.

Needs: a reachable broker; ``assign``/``seek`` only, so no consumer-group membership and no rebalances.

What bounds the work between two checkpoint barriers on Flink (``docs/streaming.md``): Beam's Flink runner never
asks a Python read to split, so each ``process`` call ends by itself, after ``max_bundle_records`` records or
``max_bundle_seconds`` (then ``defer_remainder``); the runner resumes the partition only after that bundle ended. The
read stage passes a barrier once what its call emitted was handed downstream, and each later Python stage once it
processed its open bundle (``max_bundle_size`` elements). A streaming read therefore ends its stage at a rebalance
(its own finalizing bundles stay small, see ``expand``). The same resumption also caps the read's rate: a partition
gives at most ``max_bundle_records`` per read bundle (``max_bundle_time_ms`` plus the drain, about two seconds on
a backlog), whatever the parallelism: at 2,000 the clicks job ran at 2,500 records/s at parallelism 1 and 3,500 at 2.
So take a few seconds of the job's per-subtask throughput per call (``conf/clicks.yaml``: 5,000); ``beamflow doctor``
flags settings that bring a backlog stall back. On Flink at parallelism >= 2 (the FlinkRunner, or the PortableRunner
given ``--parallelism``) the partitions are spread round robin over the read's subtasks (the runner's key hash alone
put three of four on one subtask in a measured run, and each subtask's partitions share its read cycles).

Example::

    import apache_beam as beam
    from runners.direct import local_options
    from transforms import ReadFromKafka, StopPolicy

    with beam.Pipeline(options=local_options()) as p:
        records = p | ReadFromKafka("127.0.0.1:9092", ["clicks"], group_id="clicks-job",
                                    stop=StopPolicy(at_end_offsets=True))   # bounded: up to the end offsets
        records | beam.Map(lambda r: print(r.partition, r.offset, len(r.value or b"")))
"""

from __future__ import annotations

import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.coders import FastPrimitivesCoder
from apache_beam.io.iobase import RestrictionTracker, WatermarkEstimator
from apache_beam.io.restriction_trackers import OffsetRange, OffsetRestrictionTracker
from apache_beam.io.watermark_estimators import WalltimeWatermarkEstimator
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import FlinkRunnerOptions, StandardOptions
from apache_beam.transforms.core import RestrictionProvider, WatermarkEstimatorProvider
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Duration, Timestamp
from apache_beam.utils.windowed_value import create as windowed_value

from beamflow.flink_keys import default_max_parallelism, length_prefixed, subtask_of_key
from beamflow.kafka.client import KafkaConsumerClient, open_consumer
from beamflow.kafka.commits import DEFAULT_ROUND_GAP_S, ForwardOnlyCommitter, RoundDelayedCommits
from beamflow.kafka.guard import exclusive_reader
from beamflow.kafka.pool import PROCESS_POOL
from beamflow.kafka.record import KafkaRecord, TopicPartition
from beamflow.kafka.watermark import PartitionWatermark
from transforms._global_window import GLOBAL_WINDOWS
from transforms._run_mode import is_streaming

__all__ = ["ReadFromKafka", "StartPolicy", "StopPolicy"]

_UNBOUNDED = sys.maxsize
_MAX_PARTITIONS = 1 << 20


@dataclass(frozen=True)
class StartPolicy:
    """Where a partition starts when its group has no committed offset: ``earliest``, ``latest`` or a timestamp."""

    reset: str = "earliest"
    timestamp_ms: int | None = None

    def __post_init__(self) -> None:
        if self.reset not in ("earliest", "latest", "timestamp"):
            raise ValueError(f"StartPolicy.reset must be earliest, latest or timestamp, not {self.reset!r}")
        if (self.reset == "timestamp") != (self.timestamp_ms is not None):
            raise ValueError("StartPolicy: give timestamp_ms exactly when reset='timestamp'")


@dataclass(frozen=True)
class StopPolicy:
    """Bounded reads for tests and backfills; all None/False means read forever.

    - ``at_end_offsets``: stop at the end offsets seen when each partition's restriction was created;
    - ``max_records_per_partition``: stop after that many offsets from the start of each partition;
    - ``until_ms``: stop a partition at its first record with timestamp >= until_ms, or once the wall clock passed
      until_ms while it had nothing to read; partition discovery stops then too.
    """

    at_end_offsets: bool = False
    max_records_per_partition: int | None = None
    until_ms: int | None = None


@dataclass(frozen=True)
class _ReaderConfig:
    bootstrap: str
    group_id: str
    backend: str
    consumer_config: tuple[tuple[str, Any], ...]
    start: StartPolicy
    stop: StopPolicy
    max_delay_ms: int
    idle_timeout_ms: int | None
    poll_timeout_s: float
    max_bundle_records: int
    max_bundle_seconds: float
    commit_offsets: bool
    finalize_round_gap_s: float = DEFAULT_ROUND_GAP_S
    partitions: frozenset[int] | None = None  # None: every partition of the topics

    def consumer(self) -> KafkaConsumerClient:
        return open_consumer(self.backend, self.bootstrap, self.group_id, dict(self.consumer_config))


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, order=True)
class _RoutedPartition(TopicPartition):
    """A partition's descriptor with a salt (``route``) picked so that its encoded bytes hash to a chosen subtask."""

    route: int = 0


# The coder the runner encodes the read's input with (it is typed ``Any``): Flink hashes these bytes into a key group.
_DESCRIPTOR_CODER = FastPrimitivesCoder()


@dataclass(frozen=True)
class _ReaderSpread:
    """Spreads partitions over the read's subtasks round robin, as Flink's ``KafkaSource`` assigns them.

    Why: Beam's Flink runner keys the read's input by the descriptor's encoded bytes, and Flink gives each key to
    the subtask that owns its hash's key group, so four partitions on two subtasks split 3/1 as often as 2/2 and the
    job runs at the pace of the subtask with three (measured: ``docs/streaming.md``). Partition i of a topic goes to
    subtask ``(crc32(topic) + i) % parallelism``: the descriptor carries the first salt whose key lands there (about
    ``parallelism`` tries). Round robin by count, not by backlog: a partition's pace is its subtask's read cycle,
    which lengthens with every partition the subtask reads. Weighing by backlog was tried (72k/55k/50k/33k-record
    partitions went {0, 3} / {1, 2}): it caught up no sooner, the largest partition still last, and it could put
    many small partitions on one subtask. The read's input is typed ``Any``, so its coder is ``FastPrimitivesCoder``
    and the runner sees it length-prefixed (``beamflow.flink_keys``). A job restored at another parallelism keeps
    its descriptors: their partitions stay where their keys hash, still one reader each, only not balanced.
    """

    parallelism: int
    max_parallelism: int

    def descriptor(self, topic: str, partition: int) -> TopicPartition:
        target = (zlib.crc32(topic.encode()) + partition) % self.parallelism
        for route in range(64 * self.parallelism):
            routed = _RoutedPartition(topic, partition, route)
            if self.subtask_of(routed) == target:
                return routed
        return TopicPartition(topic, partition)  # no salt found (not seen): the hash decides, as without spreading

    def subtask_of(self, descriptor: TopicPartition) -> int:
        """The read subtask the runner gives this descriptor (plain or salted) at this job's parallelism."""
        key = length_prefixed(_DESCRIPTOR_CODER.encode(descriptor))
        return subtask_of_key(key, self.max_parallelism, self.parallelism)

    @staticmethod
    def for_options(options: Any) -> _ReaderSpread | None:
        """The spread for a job on Flink at a known parallelism of 2 or more; None elsewhere (one reader, or no keyed
        input). On Flink means the FlinkRunner, or the PortableRunner given Flink's ``--parallelism`` (a job submitted
        to a Flink job server directly); the salt is harmless on any other runner such a guess could be wrong about."""
        runner = options.view_as(StandardOptions).runner
        name = runner if isinstance(runner, str) else type(runner).__name__ if runner is not None else ""
        flink = options.view_as(FlinkRunnerOptions)
        if not ("Flink" in name or "Portable" in name) or flink.parallelism is None or flink.parallelism < 2:
            return None
        max_parallelism = flink.max_parallelism
        if max_parallelism is None or max_parallelism <= 0:
            max_parallelism = default_max_parallelism(flink.parallelism)
        return _ReaderSpread(flink.parallelism, max_parallelism)


# One round tracker per consumer group and worker process: the finalizer callbacks of a group's partitions may run on
# any DoFn instance of the worker (each bundle processor has its own), and rounds are a property of the runner.
_ROUNDS: dict[tuple[str, str], RoundDelayedCommits] = {}
_ROUNDS_LOCK = threading.Lock()


def _round_delayed(config: _ReaderConfig, commit: Callable[[TopicPartition, int], object]) -> RoundDelayedCommits:
    with _ROUNDS_LOCK:
        key = (config.bootstrap, config.group_id)
        rounds = _ROUNDS.get(key)
        if rounds is None:
            rounds = _ROUNDS[key] = RoundDelayedCommits(commit, config.finalize_round_gap_s)
        return rounds


class _PartitionTracker(OffsetRestrictionTracker):
    """An offset tracker that never splits a partition in two: only checkpoints (fraction 0) are allowed.

    Two readers of one partition are exactly the failure of beam#31313; refusing runner-initiated splits keeps one
    partition, one reader, so the worker-level guard can treat a second reader as the bug it is.
    """

    def try_split(self, fraction_of_remainder: float) -> Any:
        if fraction_of_remainder > 0:
            return None
        return super().try_split(fraction_of_remainder)

    def is_bounded(self) -> bool:
        return bool(self._range.stop != _UNBOUNDED)


class _PartitionRestrictions(RestrictionProvider):
    def __init__(self, config: _ReaderConfig) -> None:
        self._config = config

    def initial_restriction(self, element: TopicPartition) -> OffsetRange:
        # Resolved once per partition; afterwards only the runner's checkpoint moves the start.
        consumer = self._config.consumer()
        try:
            low, high = consumer.watermarks(element)
            committed = consumer.committed(element)
            start_policy = self._config.start
            if committed is not None:
                start = max(committed, low)
            elif start_policy.reset == "earliest":
                start = low
            elif start_policy.reset == "latest":
                start = high
            else:
                assert start_policy.timestamp_ms is not None
                found = consumer.offset_for_time(element, start_policy.timestamp_ms)
                start = high if found is None else found
        finally:
            consumer.close()
        stop_policy = self._config.stop
        stop = _UNBOUNDED
        if stop_policy.at_end_offsets:
            stop = min(stop, max(high, start))
        if stop_policy.max_records_per_partition is not None:
            stop = min(stop, start + stop_policy.max_records_per_partition)
        return OffsetRange(start, stop)

    def create_tracker(self, restriction: OffsetRange) -> RestrictionTracker:
        return _PartitionTracker(restriction)

    def restriction_size(self, element: TopicPartition, restriction: OffsetRange) -> float:
        if restriction.stop == _UNBOUNDED:
            return 1.0
        return float(max(restriction.stop - restriction.start, 0))

    def split(self, element: TopicPartition, restriction: OffsetRange) -> Iterator[OffsetRange]:
        yield restriction  # one restriction per partition, never more


class _PartitionWatermarkEstimator(WatermarkEstimator):
    def __init__(self, state: tuple[int, int | None], max_delay_ms: int, idle_timeout_ms: int | None) -> None:
        self.logic = PartitionWatermark(max_delay_ms, idle_timeout_ms, state[0], state[1])

    def observe_timestamp(self, timestamp: Timestamp) -> None:
        pass  # the DoFn accounts for records itself (it needs the "late" answer per record)

    def current_watermark(self) -> Timestamp:
        return Timestamp(micros=self.logic.watermark_ms * 1000)

    def get_estimator_state(self) -> tuple[int, int | None]:
        return self.logic.as_state()

    def partition_watermark(self) -> PartitionWatermark:
        return self.logic


class _PartitionWatermarks(WatermarkEstimatorProvider):
    def __init__(self, config: _ReaderConfig) -> None:
        self._config = config

    def initial_estimator_state(self, element: TopicPartition, restriction: OffsetRange) -> tuple[int, int | None]:
        return PartitionWatermark(self._config.max_delay_ms, self._config.idle_timeout_ms).as_state()

    def create_watermark_estimator(self, estimator_state: tuple[int, int | None]) -> WatermarkEstimator:
        return _PartitionWatermarkEstimator(estimator_state, self._config.max_delay_ms, self._config.idle_timeout_ms)


class _ReadPartitionFn(beam.DoFn, _PartitionRestrictions, _PartitionWatermarks):
    """Reads one partition per element; the DoFn is its own restriction and watermark-estimator provider."""

    def __init__(self, config: _ReaderConfig, event_time_fn: Callable[[KafkaRecord], int] | None) -> None:
        beam.DoFn.__init__(self)
        self._config = config
        self._event_time_fn = event_time_fn

    def setup(self) -> None:
        self._committer: ForwardOnlyCommitter | None = None
        ns = "beamflow.kafka"
        self._records = Metrics.counter(ns, "records_read")
        self._bytes = Metrics.counter(ns, "bytes_read")
        self._late = Metrics.counter(ns, "late_records")
        self._idle = Metrics.counter(ns, "idle_polls")

    def _commit(self, tp: TopicPartition, next_offset: int) -> None:
        """Commits a finalized bundle's next offset. A bounded read commits at once; the local runner finalizes before
        later stages run, so jobs that must not commit ahead of their sinks use ``CommitOffsetsAfter`` instead."""
        if self._committer is None:
            self._committer = ForwardOnlyCommitter(self._config.consumer())
        if self._committer.commit(tp, next_offset):
            Metrics.gauge("beamflow.kafka", f"committed_offset.{tp}").set(next_offset)

    def _finalized(self, tp: TopicPartition, next_offset: int) -> None:
        self._commit(tp, next_offset)

    def _report(
        self,
        tp: TopicPartition,
        consumer: KafkaConsumerClient,
        restriction: OffsetRange,
        last_claimed: int | None,
        emitted: int,
        watermark: PartitionWatermark,
        late: int,
    ) -> None:
        """Per-partition metrics, once per bundle: records, late records (so a partition that comes back from
        idleness with old records shows which partition they came from), consumer lag (end offset minus position),
        idleness."""
        ns = "beamflow.kafka"
        if emitted:
            Metrics.counter(ns, f"records_read.{tp}").inc(emitted)
        if late:
            Metrics.counter(ns, f"late_records.{tp}").inc(late)
        position = restriction.start if last_claimed is None else last_claimed + 1
        try:
            _, high = consumer.watermarks(tp, timeout_s=2.0)
        except Exception:  # metrics must never fail a bundle
            return
        Metrics.gauge(ns, f"lag.{tp}").set(max(0, high - position))
        idle = emitted == 0 and watermark.idle_timeout_ms is not None and high <= position
        Metrics.gauge(ns, f"idle.{tp}").set(1 if idle else 0)

    def _event_time_ms(self, record: KafkaRecord) -> int:
        return self._event_time_fn(record) if self._event_time_fn else record.timestamp_ms

    # The finalizer parameter must come before the restriction and watermark parameters (Beam passes it
    # positionally; the other order fails with "got multiple values for argument").
    def process(
        self,
        element: TopicPartition,
        bundle_finalizer: Any = beam.DoFn.BundleFinalizerParam,
        tracker: Any = beam.DoFn.RestrictionParam(),
        watermark_estimator: Any = beam.DoFn.WatermarkEstimatorParam(),
    ) -> Iterable[Any]:
        return self._read(element, bundle_finalizer, tracker, watermark_estimator)

    def _read(
        self, descriptor: TopicPartition, bundle_finalizer: Any, tracker: Any, watermark_estimator: Any
    ) -> Iterator[Any]:
        config = self._config
        tp = TopicPartition(descriptor.topic, descriptor.partition)  # without a spread's salt (pools, guard, commits)
        restriction: OffsetRange = tracker.current_restriction()
        watermark: PartitionWatermark = watermark_estimator.partition_watermark()
        if restriction.start >= restriction.stop:
            return  # nothing to read (an empty partition in a bounded read): done without a poll
        with (
            exclusive_reader(config.bootstrap, config.group_id, tp.topic, tp.partition),
            PROCESS_POOL.checkout((config, tp), config.consumer) as consumer,
        ):
            consumer.assign(tp, restriction.start)
            deadline = time.monotonic() + config.max_bundle_seconds
            emitted = late_here = 0
            last_claimed: int | None = None
            try:
                while True:
                    wanted = min(2000, config.max_bundle_records)
                    if restriction.stop != _UNBOUNDED:
                        # Never fetch past the restriction's end (those records would be thrown away).
                        next_offset = restriction.start if last_claimed is None else last_claimed + 1
                        wanted = max(1, min(wanted, restriction.stop - next_offset))
                    records = consumer.poll(wanted, config.poll_timeout_s)
                    now = _now_ms()
                    if not records:
                        self._idle.inc()
                        watermark.observe_caught_up(now)
                        if config.stop.until_ms is not None and now >= config.stop.until_ms:
                            tracker.try_claim(restriction.stop)  # the policy's end: finish this partition
                            return
                        tracker.defer_remainder(Duration(seconds=0.5))
                        return
                    if config.stop.until_ms is not None:
                        # Per record: the until_ms policy may end the partition in the middle of a poll.
                        for record in records:
                            event_ms = self._event_time_ms(record)
                            if event_ms >= config.stop.until_ms:
                                tracker.try_claim(restriction.stop)
                                return
                            if not tracker.try_claim(record.offset):
                                return
                            last_claimed = record.offset
                            if watermark.observe_record(event_ms, now):
                                self._late.inc()
                                late_here += 1
                            self._records.inc()
                            self._bytes.inc(len(record.value or b"") + len(record.key or b""))
                            emitted += 1
                            yield windowed_value(record, int(event_ms * 1000), GLOBAL_WINDOWS)
                    else:
                        # One claim per poll: claiming the highest offset of the batch claims the offsets below it,
                        # and every record emitted is at or below the claim, so a checkpoint taken at any point
                        # resumes exactly after what was emitted. Records at or past the restriction's end are not
                        # emitted; claiming the first of them ends the restriction, as a per-record claim would.
                        stop = tracker.current_restriction().stop
                        beyond = None
                        if records[-1].offset >= stop:
                            beyond = next(r for r in records if r.offset >= stop)
                            records = [r for r in records if r.offset < stop]
                        if records:
                            if not tracker.try_claim(records[-1].offset):
                                return
                            last_claimed = records[-1].offset
                            # int(): windowed values hold integer microseconds; a user function may return a float.
                            stamps = [int(self._event_time_ms(r)) for r in records] if self._event_time_fn else None
                            late, size = 0, 0
                            wm, delay = watermark.watermark_ms, watermark.max_delay_ms
                            for i, record in enumerate(records):
                                event_ms = stamps[i] if stamps is not None else record.timestamp_ms
                                if event_ms < wm:
                                    late += 1
                                if event_ms - delay > wm:
                                    wm = event_ms - delay
                                value, key = record.value, record.key
                                size += (len(value) if value else 0) + (len(key) if key else 0)
                                # The partitions come from the read's own Impulse + Reshuffle, so always in the global
                                # window; a windowed value from micros saves a window assignment and a Timestamp.
                                yield windowed_value(record, event_ms * 1000, GLOBAL_WINDOWS)
                            # Published only now, after every record it covers was emitted.
                            watermark.watermark_ms = wm
                            watermark.last_activity_wall_ms = now
                            emitted += len(records)
                            self._records.inc(len(records))
                            self._bytes.inc(size)
                            if late:
                                self._late.inc(late)
                                late_here += late
                        if beyond is not None:
                            tracker.try_claim(beyond.offset)  # fails: the restriction is complete
                            return
                    if last_claimed is not None and last_claimed >= restriction.stop - 1:
                        return  # the restriction's last offset is claimed: done, no need to wait on another poll
                    if emitted >= config.max_bundle_records or time.monotonic() >= deadline:
                        # Hand the bundle back so the runner can make it durable and finalize (commit) it.
                        tracker.defer_remainder(Duration(seconds=0))
                        return
            finally:
                if config.commit_offsets:
                    # Also when nothing was read: on a stream a finalization round is what commits the previous
                    # round's offsets, so a partition that went quiet must keep marking rounds, or its last offsets
                    # would never be committed (the group would lag forever behind a caught-up job).
                    next_offset = restriction.start if last_claimed is None else last_claimed + 1
                    bundle_finalizer.register(lambda: self._finalized(tp, next_offset))
                self._report(tp, consumer, restriction, last_claimed, emitted, watermark, late_here)


class _UnboundedReadPartitionFn(_ReadPartitionFn):
    """A streaming read: commits one finalization round late (see ``RoundDelayedCommits`` for why)."""

    def _finalized(self, tp: TopicPartition, next_offset: int) -> None:
        _round_delayed(self._config, self._commit).finalized(tp, next_offset)

    @beam.DoFn.unbounded_per_element()
    def process(
        self,
        element: TopicPartition,
        bundle_finalizer: Any = beam.DoFn.BundleFinalizerParam,
        tracker: Any = beam.DoFn.RestrictionParam(),
        watermark_estimator: Any = beam.DoFn.WatermarkEstimatorParam(),
    ) -> Iterable[Any]:
        return self._read(element, bundle_finalizer, tracker, watermark_estimator)


# The partition watcher's watermark. Without an estimator an unbounded watcher holds its output watermark at the
# minimum forever, and with it every downstream watermark: no event-time window would ever fire in a stream.
_WALL_CLOCK = WalltimeWatermarkEstimator.default_provider()


class _WatchPartitionsFn(beam.DoFn, RestrictionProvider):
    """Emits each partition of a topic exactly once, including partitions added while the job runs.

    The restriction is a range of partition numbers; claiming number i means "partition i was handed to the
    readers". A claim lives in the runner's checkpoint, so a restored job neither re-emits nor forgets a partition.
    """

    def __init__(self, config: _ReaderConfig, poll_interval_s: float, spread: _ReaderSpread | None = None) -> None:
        self._config = config
        self._poll_interval_s = poll_interval_s
        self._spread = spread

    def initial_restriction(self, element: str) -> OffsetRange:
        if self._config.stop.at_end_offsets or self._config.stop.max_records_per_partition is not None:
            consumer = self._config.consumer()
            try:
                return OffsetRange(0, len(consumer.partitions(element)))
            finally:
                consumer.close()
        return OffsetRange(0, _MAX_PARTITIONS)

    def create_tracker(self, restriction: OffsetRange) -> RestrictionTracker:
        return OffsetRestrictionTracker(restriction)

    def restriction_size(self, element: str, restriction: OffsetRange) -> float:
        return 1.0

    def setup(self) -> None:
        self._client: KafkaConsumerClient | None = None

    def teardown(self) -> None:
        if self._client is not None:
            self._client.close()

    def process(
        self,
        topic: str,
        tracker: Any = beam.DoFn.RestrictionParam(),
        _wm: Any = beam.DoFn.WatermarkEstimatorParam(_WALL_CLOCK),
    ) -> Iterator[Any]:
        return self._watch(topic, tracker)

    def _watch(self, topic: str, tracker: Any) -> Iterator[Any]:
        if self._client is None:
            self._client = self._config.consumer()
        existing = set(self._client.partitions(topic))
        position = tracker.current_restriction().start
        wanted = self._config.partitions
        while position in existing:
            if not tracker.try_claim(position):
                return
            if wanted is not None and position not in wanted:
                # Claimed all the same: another read (another process of a local run) owns this partition.
                position += 1
                continue
            # Stamped with the wall clock, as the watcher's watermark is: a descriptor is never late, and the
            # watcher (which may wait forever for new partitions) never holds event time back.
            spread = self._spread
            descriptor = spread.descriptor(topic, position) if spread is not None else TopicPartition(topic, position)
            yield TimestampedValue(descriptor, time.time())
            position += 1
        until = self._config.stop.until_ms
        if until is not None and _now_ms() >= until:
            tracker.try_claim(tracker.current_restriction().stop)
            return
        tracker.defer_remainder(Duration(seconds=self._poll_interval_s))


class _UnboundedWatchPartitionsFn(_WatchPartitionsFn):
    @beam.DoFn.unbounded_per_element()
    def process(
        self,
        topic: str,
        tracker: Any = beam.DoFn.RestrictionParam(),
        _wm: Any = beam.DoFn.WatermarkEstimatorParam(_WALL_CLOCK),
    ) -> Iterator[Any]:
        return self._watch(topic, tracker)


def _topics_of(_impulse: bytes, topics: list[str]) -> list[str]:
    return topics


class ReadFromKafka(beam.PTransform):
    """Reads topics as ``KafkaRecord`` elements (topic, partition, offset, timestamp_ms, key, value, headers).

    Args:
        bootstrap: broker list.
        topics: topics to read; every partition, including ones added while running, is read exactly once.
        group_id: consumer group whose committed offsets are the start of a new job and the monitoring of a running
            one (committed only forward, only after the runner made the output durable).
        backend: ``confluent`` (librdkafka, fast) or ``kafka-python`` (pure Python).
        start: where partitions without a committed offset start.
        stop: bounded modes; default reads forever.
        event_time_fn: record -> event time in epoch milliseconds (default: the record timestamp).
        max_delay_ms: allowed out-of-orderness; the partition watermark trails the newest timestamp by this much.
        idle_timeout_ms: wall time with nothing to read after which a partition's watermark advances to now minus
            ``max_delay_ms`` (None disables idleness; then one silent partition holds every window back).
        commit_offsets: commit to the group from the bundle finalizer (on by default; never auto-commit); a
            streaming read commits one finalization round late.
        finalize_round_gap_s: a pause between finalizer calls longer than this starts a new round (streaming);
            keep it below the minimum pause between checkpoints.
        partitions: read only these partition numbers of each topic (None: all). A local run split over processes
            gives each process its own partitions; the group's offsets of the others are left to their readers.
    """

    def __init__(
        self,
        bootstrap: str,
        topics: Sequence[str],
        group_id: str,
        backend: str = "confluent",
        start: StartPolicy = StartPolicy(),
        stop: StopPolicy = StopPolicy(),
        event_time_fn: Callable[[KafkaRecord], int] | None = None,
        max_delay_ms: int = 0,
        idle_timeout_ms: int | None = 30_000,
        commit_offsets: bool = True,
        consumer_config: dict[str, Any] | None = None,
        poll_timeout_s: float = 0.5,
        max_bundle_records: int = 20_000,
        max_bundle_seconds: float = 1.0,
        partition_poll_interval_s: float = 5.0,
        finalize_round_gap_s: float = DEFAULT_ROUND_GAP_S,
        partitions: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if not topics:
            raise ValueError("ReadFromKafka needs at least one topic")
        if "enable.auto.commit" in (consumer_config or {}) or "enable_auto_commit" in (consumer_config or {}):
            raise ValueError("auto-commit is not configurable: offsets are committed only from bundle finalizers")
        self._topics = list(topics)
        self._config = _ReaderConfig(
            bootstrap=bootstrap,
            group_id=group_id,
            backend=backend,
            consumer_config=tuple(sorted((consumer_config or {}).items())),
            start=start,
            stop=stop,
            max_delay_ms=max_delay_ms,
            idle_timeout_ms=idle_timeout_ms,
            poll_timeout_s=poll_timeout_s,
            max_bundle_records=max_bundle_records,
            max_bundle_seconds=max_bundle_seconds,
            commit_offsets=commit_offsets,
            finalize_round_gap_s=finalize_round_gap_s,
            partitions=None if partitions is None else frozenset(partitions),
        )
        self._event_time_fn = event_time_fn
        self._partition_poll_interval_s = partition_poll_interval_s

    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection[KafkaRecord]:
        # Finite restrictions (end offsets, record counts) make a bounded read; otherwise the read is unbounded
        # and ends only by the until_ms policy.
        finite = self._config.stop.at_end_offsets or self._config.stop.max_records_per_partition is not None
        watch_cls = _WatchPartitionsFn if finite else _UnboundedWatchPartitionsFn
        read_cls = _ReadPartitionFn if finite else _UnboundedReadPartitionFn
        spread = _ReaderSpread.for_options(pbegin.pipeline.options) if not finite else None
        watch = watch_cls(self._config, self._partition_poll_interval_s, spread)
        read = read_cls(self._config, self._event_time_fn)
        records = (
            pbegin
            # Impulse + FlatMap rather than Create: Create's expansion adds a pickled-Python reshuffle that portable
            # runners (Prism) cannot run, and a lambda label that changes with Beam's source lines.
            | "Impulse" >> beam.Impulse()
            | "Topics" >> beam.FlatMap(_topics_of, self._topics)
            | "DiscoverPartitions" >> beam.ParDo(watch)
            # One partition per element from here on: let the runner spread them over workers.
            | "SpreadPartitions" >> beam.Reshuffle()
            | "ReadPartitions" >> beam.ParDo(read)
        )
        if is_streaming(records):
            # A streaming read ends its stage here. Beam's Flink runner turns Reshuffle into a plain network
            # rebalance (no state), which (1) keeps the read's stage small: each of its bundles asks for finalization
            # and holds its bundle processor until the next checkpoint completes, so the runner builds a new processor
            # for nearly every bundle, which must not mean new decoders, pools and sinks for every stage fused in;
            # and (2) spreads records over every subtask however the partitions fell to the readers.
            records = records | "Rebalance" >> beam.Reshuffle()
        return records
