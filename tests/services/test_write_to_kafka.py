"""WriteToKafka and its engine on a real broker and a real PostgreSQL, counted by a plain ``read_committed`` consumer.

Exactly-once through a SIGKILLed writer process at each hard moment (ledger claimed; records produced inside the open
transaction; Kafka committed but the ledger not settled), then a fresh writer replaying the same input; two
deliberately broken writers kept as tests, to show the count catches a missing ledger skip (duplicates) and a
pending attempt trusted without its marker (loss). Zombies: a writer fenced by a newer one fails its write, its
retry is not wedged, and a pending attempt is never decided by a writer that does not hold the newest epoch. The
Beam transform on the local runner: a replayed pipeline writes nothing (bounded input, and Kafka to Kafka through the
streaming path), records too large go to dead letters with their reason, and so do records stamped where the topic
would refuse them or delete them (``TopicLimits``), a delivery failure fails the pipeline, at-least-once
writes everything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.window import TimestampedValue
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from beamflow.kafka.admin import create_topic, produce
from beamflow.kafka.exactly_once import ExactlyOnceShardWriter
from beamflow.kafka.ledger import ShardLedger
from beamflow.kafka.producer import (
    AtLeastOnceWriter,
    KafkaWriteError,
    ProducerRecord,
    ShardFenced,
    record_size,
)
from beamflow.services import ServiceState
from runners.direct import local_options
from transforms.read_from_kafka import ReadFromKafka, StopPolicy
from transforms.write_to_kafka import WriteToKafka, close_shared_writers

pytestmark = pytest.mark.services

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_committed(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[bytes]:
    """Every value a ``read_committed`` consumer sees in ``topic``, read to the end (the last stable offset)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"count-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        # For a read_committed consumer the high mark is the last stable offset; its position passes control records.
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        values: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            positions = consumer.position([TopicPartition(topic, p) for p in partitions])
            if all(tp.offset >= ends[tp.partition] for tp in positions if ends[tp.partition] > 0):
                return values
            for message in consumer.consume(1000, 0.2):
                value = message.value()
                if message.error() is None and value is not None:
                    values.append(value)
        raise AssertionError(f"did not reach the end of {topic} in {timeout_s}s (at {len(values)} values)")
    finally:
        consumer.close()


def exactly_once_problems(seen: list[bytes], expected: list[bytes]) -> list[str]:
    counts = Counter(seen)
    duplicated = sorted(v for v, n in counts.items() if n > 1)
    missing = sorted(set(expected) - set(counts))
    extra = sorted(set(counts) - set(expected))
    problems = []
    if duplicated:
        problems.append(f"{len(duplicated)} duplicated, e.g. {duplicated[:3]}")
    if missing:
        problems.append(f"{len(missing)} missing, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{len(extra)} unexpected, e.g. {extra[:3]}")
    return problems


def _records(n: int) -> list[ProducerRecord]:
    return [ProducerRecord(f"result-{i:04d}".encode(), key=f"k{i % 7}".encode()) for i in range(n)]


def _batches(records: list[ProducerRecord], size: int) -> list[list[ProducerRecord]]:
    return [records[i : i + size] for i in range(0, len(records), size)]


@pytest.fixture
def topic(kafka: ServiceState) -> Iterator[str]:
    name = f"sink-{uuid.uuid4().hex[:8]}"
    create_topic(kafka.info["bootstrap"], name, 3)
    yield name


@pytest.fixture
def ledger(postgres: ServiceState) -> Iterator[ShardLedger]:
    shard_ledger = ShardLedger(postgres.info["dsn"], f"ledger_{uuid.uuid4().hex[:8]}")
    yield shard_ledger
    shard_ledger.close()


# ---- crash at each hard moment ---------------------------------------------------------------------------------

# A writer process that dies by SIGKILL at one phase of its second batch. At "produced" it first flushes, so the
# records sit in the broker's log inside the open transaction (what a crash mid-transaction leaves behind).
_CRASHING_WRITER = """
import json, os, signal, sys
from beamflow.kafka.exactly_once import ExactlyOnceShardWriter
from beamflow.kafka.ledger import ShardLedger
from beamflow.kafka.producer import ProducerRecord
args = json.loads(sys.argv[1])

class Crashing(ExactlyOnceShardWriter):
    batch = 0

    def _phase(self, name):
        if self.batch == 1 and name == args["phase"]:
            if name == "produced":
                self._producer.flush(30)
            os.kill(os.getpid(), signal.SIGKILL)

writer = Crashing(args["bootstrap"], args["topic"], args["group"], 0, ShardLedger(args["dsn"], args["table"]))
for i, batch in enumerate(args["batches"]):
    writer.batch = i
    writer.write([ProducerRecord(v.encode(), key=k.encode()) for k, v in batch])
raise SystemExit("not killed")
"""


class _NoLedgerSkip(ExactlyOnceShardWriter):
    """Deliberately broken: never recognises a replay (the ledger skip disabled)."""

    def _claim_ids(self, conn: Any, keys: list[str], attempt: int) -> list[str]:
        conn.execute(  # forget them, so every one is claimed again as new
            f"DELETE FROM {self.ledger.table} WHERE sink_group = %s AND record_key = ANY(%s)", (self.sink_group, keys)
        )
        return super()._claim_ids(conn, keys, attempt)


class _TrustsPending(ExactlyOnceShardWriter):
    """Deliberately broken: takes a pending attempt as committed without asking its Kafka marker."""

    def _resolve(self, conn: Any, attempt: int, committed: int) -> None:
        conn.execute(
            f"UPDATE {self.ledger.table}_shards SET pending = false, committed = %s "
            "WHERE sink_group = %s AND shard = %s",
            (attempt, self.sink_group, self.shard),
        )


CASES = [
    ("claimed", ExactlyOnceShardWriter, "exactly once"),
    ("produced", ExactlyOnceShardWriter, "exactly once"),
    ("committed", ExactlyOnceShardWriter, "exactly once"),
    ("committed", _NoLedgerSkip, "duplicated"),
    ("produced", _TrustsPending, "missing"),
]


@pytest.mark.parametrize(
    ("phase", "replayer", "outcome"), CASES, ids=[f"{p}-{r.__name__.strip('_')}" for p, r, _ in CASES]
)
def test_crash_at_each_moment_then_replay(
    phase: str,
    replayer: type[ExactlyOnceShardWriter],
    outcome: str,
    kafka: ServiceState,
    postgres: ServiceState,
    topic: str,
    ledger: ShardLedger,
) -> None:
    bootstrap, group = kafka.info["bootstrap"], f"sink-group-{uuid.uuid4().hex[:6]}"
    records = _records(150)
    batches = _batches(records, 50)
    args = {
        "bootstrap": bootstrap,
        "topic": topic,
        "group": group,
        "dsn": postgres.info["dsn"],
        "table": ledger.table,
        "phase": phase,
        "batches": [[(r.key.decode(), r.value.decode()) for r in b if r.key and r.value] for b in batches],
    }
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_WRITER, json.dumps(args)], cwd=ROOT, capture_output=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    # The job restarts: a fresh writer gets the same input again, as a replay of every batch (bundles may differ).
    writer = replayer(bootstrap, topic, group, 0, ledger)
    try:
        for batch in _batches(records, 40):
            writer.write(batch)
    finally:
        writer.close()
    problems = exactly_once_problems(read_committed(bootstrap, topic), [r.value for r in records if r.value])
    if outcome == "exactly once":
        assert problems == []
        if phase == "committed":
            assert writer.stats.recovered_committed == 1 and writer.stats.written == 50  # batch 2 only
        else:
            assert writer.stats.recovered_aborted == 1 and writer.stats.written == 100  # batches 1 and 2
    else:  # the broken writer is caught by the same count
        assert any(p.split(" ")[1].startswith(outcome) for p in problems), problems


# ---- zombies -----------------------------------------------------------------------------------------------------


def test_zombie_is_fenced_its_retry_is_not_wedged_and_nothing_doubles(
    kafka: ServiceState, topic: str, ledger: ShardLedger
) -> None:
    bootstrap, group = kafka.info["bootstrap"], f"zombie-{uuid.uuid4().hex[:6]}"
    batches = _batches(_records(120), 30)
    old = ExactlyOnceShardWriter(bootstrap, topic, group, 1, ledger)
    new = ExactlyOnceShardWriter(bootstrap, topic, group, 1, ledger)
    late = ExactlyOnceShardWriter(bootstrap, topic, group, 1, ledger)
    later = ExactlyOnceShardWriter(bootstrap, topic, group, 1, ledger)
    try:
        old.write(batches[0])
        new.write(batches[1])  # init_transactions bumps the epoch: `old` is now a zombie
        with pytest.raises(ShardFenced):  # it sees the shard moved on in the ledger before touching Kafka
            old.write(batches[2])
        # Retried (its bundle replayed), the old instance starts over: init_transactions fences `new` in turn.
        old.write(batches[2])
        with pytest.raises(ShardFenced):
            new.write(batches[3])
        new.write(batches[3])  # and `new`'s retry goes through too
        # Fenced by Kafka itself: `late` claims in the ledger, then its transaction meets `later`'s newer epoch.
        late._ensure_producer()
        later._ensure_producer()
        with pytest.raises(ShardFenced):
            late.write([ProducerRecord(b"late-zombie", key=b"z")])
        later.write(batches[0] + batches[1])  # decides late's pending attempt (aborted); the replays are skipped
        assert later.stats.recovered_aborted == 1 and later.stats.skipped_replays == 60
        assert (old.stats.fenced, new.stats.fenced, late.stats.fenced) == (1, 1, 1)
    finally:
        for writer in (old, new, late, later):
            writer.close()
    # Each batch once; the zombie's record was aborted in Kafka and is not visible.
    expected = [r.value for b in batches for r in b if r.value]
    assert exactly_once_problems(read_committed(bootstrap, topic), expected) == []


def test_a_pending_attempt_is_not_decided_by_a_writer_without_the_newest_epoch(
    kafka: ServiceState, topic: str, ledger: ShardLedger
) -> None:
    # B starts first, A later (A holds the newer epoch). A claims an attempt; before A commits it, B finds it
    # pending with no marker. Deciding "aborted" on that alone would delete A's ids while A can still commit; B's
    # fencing probe fails instead, nothing is decided, and A's commit stands.
    bootstrap, group = kafka.info["bootstrap"], f"race-{uuid.uuid4().hex[:6]}"
    records = _records(40)
    writer_b = ExactlyOnceShardWriter(bootstrap, topic, group, 2, ledger)
    writer_a = ExactlyOnceShardWriter(bootstrap, topic, group, 2, ledger)
    try:
        writer_b._ensure_producer()
        writer_a._ensure_producer()
        claim = writer_a._claim(records[:20])
        with pytest.raises(ShardFenced):
            writer_b.write(records[20:])
        assert writer_b.stats.recovered_aborted == 0
        writer_a._transaction(claim)
        writer_a._settle(claim.attempt, [])
        writer_a.write(records)  # the rest; the first 20 are recognised
        assert writer_a.stats.skipped_replays == 20
    finally:
        writer_a.close()
        writer_b.close()
    assert exactly_once_problems(read_committed(bootstrap, topic), [r.value for r in records if r.value]) == []


def test_refusals_of_the_engine(kafka: ServiceState, topic: str, ledger: ShardLedger) -> None:
    bootstrap = kafka.info["bootstrap"]
    with pytest.raises(ValueError, match="shards must be <= the topic's partitions"):
        ExactlyOnceShardWriter(bootstrap, topic, "g", 3, ledger)  # the topic has partitions 0..2
    group = f"one-topic-{uuid.uuid4().hex[:6]}"
    writer = ExactlyOnceShardWriter(bootstrap, topic, group, 0, ledger)
    writer.write(_records(3))
    writer.close()
    other = f"sink-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, other, 1)
    stray = ExactlyOnceShardWriter(bootstrap, other, group, 0, ledger)
    with pytest.raises(ValueError, match="one sink group per sink"):
        stray.write(_records(3))
    stray.close()


def test_ledger_pruning_forgets_old_ids_but_never_a_pending_attempt(
    kafka: ServiceState, topic: str, postgres: ServiceState
) -> None:
    import psycopg

    ledger = ShardLedger(postgres.info["dsn"], f"ledger_{uuid.uuid4().hex[:8]}", retention_s=0.5)
    group = f"prune-{uuid.uuid4().hex[:6]}"
    writer = ExactlyOnceShardWriter(kafka.info["bootstrap"], topic, group, 0, ledger)
    try:
        writer.write(_records(10))
        pending = writer._claim(_records(15)[10:])  # claimed, never committed: pending
        time.sleep(1.0)
        assert ledger.prune(group) == 10
        with psycopg.connect(postgres.info["dsn"]) as conn:
            row = conn.execute(f"SELECT count(*) FROM {ledger.table} WHERE attempt = %s", (pending.attempt,)).fetchone()
        assert row is not None and row[0] == 5
    finally:
        writer.close()
        ledger.close()


def test_pruning_an_aborted_attempt_takes_its_ids_with_it(
    kafka: ServiceState, topic: str, postgres: ServiceState
) -> None:
    # An aborted attempt's ids stay in the ledger, made new again by its `_attempts` row's mark. Pruning must take the
    # ids with the row: an id whose aborted mark was pruned before it would count as written, and its replay would be
    # skipped (lost).
    # Long enough that the writers' own pruning (each writer's first write prunes) finds nothing due before the
    # sleep below, however slowly a producer starts.
    ledger = ShardLedger(postgres.info["dsn"], f"ledger_{uuid.uuid4().hex[:8]}", retention_s=4.0)
    bootstrap, group = kafka.info["bootstrap"], f"prune-aborted-{uuid.uuid4().hex[:6]}"
    records = _records(25)
    first = ExactlyOnceShardWriter(bootstrap, topic, group, 0, ledger)
    second = ExactlyOnceShardWriter(bootstrap, topic, group, 0, ledger)
    third = ExactlyOnceShardWriter(bootstrap, topic, group, 0, ledger)
    try:
        first.write(records[:10])
        first._claim(records[10:15])  # claimed, never produced: the crash of a writer mid-attempt
        second.write(records[20:25])  # fences `first` and decides its pending attempt: aborted
        assert second.stats.recovered_aborted == 1
        second.close()  # settles its own attempt: nothing pending is left to keep
        with ledger.pool.connection() as conn:
            row = conn.execute(
                f"SELECT count(*) FROM {ledger.table} r JOIN {ledger.table}_attempts a USING (sink_group, shard, "
                "attempt) WHERE r.sink_group = %s AND a.aborted",
                (group,),
            ).fetchone()
        assert row is not None and row[0] == 5  # the aborted attempt's ids, still there
        time.sleep(4.5)  # past 1.1 retentions: due
        assert ledger.prune(group) == 20
        third.write(records[10:15])  # the aborted records' replay, after the pruning: written, not skipped
        assert (third.stats.written, third.stats.skipped_replays) == (5, 0)
    finally:
        for writer in (first, second, third):
            writer.close()
        ledger.close()
    expected = [r.value for r in records[:15] + records[20:] if r.value]
    assert exactly_once_problems(read_committed(bootstrap, topic), expected) == []


def test_each_committed_attempt_is_settled_by_the_next_claim_or_by_close(
    kafka: ServiceState, topic: str, ledger: ShardLedger
) -> None:
    # Step 3 rides on the next claim's transaction: the writer never asks the Kafka marker about its own attempts, and
    # closing settles the last one, so the next writer finds nothing pending.
    bootstrap, group = kafka.info["bootstrap"], f"settle-{uuid.uuid4().hex[:6]}"
    batches = _batches(_records(90), 30)

    def shard_row() -> tuple[Any, ...]:
        with ledger.pool.connection() as conn:
            row = conn.execute(
                f"SELECT attempt, pending, committed FROM {ledger.table}_shards WHERE sink_group = %s", (group,)
            ).fetchone()
        assert row is not None
        return tuple(row)

    first = ExactlyOnceShardWriter(bootstrap, topic, group, 0, ledger)
    try:
        first.write(batches[0])
        assert shard_row() == (1, True, 0)  # committed in Kafka, not yet settled
        first.write(batches[1])
        assert shard_row() == (2, True, 1)
    finally:
        first.close()
    assert shard_row() == (2, False, 2)
    second = ExactlyOnceShardWriter(bootstrap, topic, group, 0, ledger)
    try:
        second.write(batches[1] + batches[2])
        assert second.stats.skipped_replays == 30 and second.stats.written == 30
    finally:
        second.close()
    assert (first.stats.recovered_committed, second.stats.recovered_committed) == (0, 0)
    expected = [r.value for b in batches for r in b if r.value]
    assert exactly_once_problems(read_committed(bootstrap, topic), expected) == []


def test_an_earlier_ledger_is_migrated_and_its_ids_still_recognised(
    kafka: ServiceState, topic: str, postgres: ServiceState
) -> None:
    # A ledger in the earlier format (an index by attempt, no aborted column), holding ids the earlier sink wrote
    # and committed: after the upgrade those records are still replays, and each new id costs one index entry.
    import psycopg

    table, group = f"ledger_{uuid.uuid4().hex[:8]}", f"upgrade-{uuid.uuid4().hex[:6]}"
    records = _records(30)
    old = ShardLedger(postgres.info["dsn"], table)
    writer = ExactlyOnceShardWriter(kafka.info["bootstrap"], topic, group, 0, old)
    try:
        writer.write(records[:20])
    finally:
        writer.close()
        old.close()
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as conn:
        conn.execute(f"CREATE INDEX {table}_attempt ON {table} (sink_group, shard, attempt)")
        conn.execute(f"ALTER TABLE {table}_attempts DROP COLUMN aborted")
    upgraded = ShardLedger(postgres.info["dsn"], table)
    writer = ExactlyOnceShardWriter(kafka.info["bootstrap"], topic, group, 0, upgraded)
    try:
        assert writer.write(records)[0] == 10
        assert writer.stats.skipped_replays == 20
    finally:
        writer.close()
        upgraded.close()
    with psycopg.connect(postgres.info["dsn"]) as conn:
        indexes = conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = %s", (table,)).fetchall()
        aborted = conn.execute(f"SELECT count(*) FROM {table}_attempts WHERE NOT aborted").fetchone()
    assert [name for (name,) in indexes] == [f"{table}_pkey"]
    assert aborted is not None and aborted[0] == 2
    assert (
        exactly_once_problems(read_committed(kafka.info["bootstrap"], topic), [r.value for r in records if r.value])
        == []
    )


# ---- the Beam transform on the local runner ----------------------------------------------------------------------


def _counter(result: Any, name: str) -> int:
    counters = result.metrics().query(MetricsFilter().with_name(name))["counters"]
    return sum(c.committed or 0 for c in counters)


def test_pipeline_replay_writes_nothing_and_too_large_goes_to_dead_letters(
    kafka: ServiceState, postgres: ServiceState, topic: str
) -> None:
    bootstrap = kafka.info["bootstrap"]
    results = [{"user": f"u{i}", "n": i} for i in range(300)]
    huge = {"user": "huge", "n": -1, "blob": "x" * 1_200_000}  # above the producer's 1,000,000-byte default
    group = f"beam-{uuid.uuid4().hex[:6]}"
    written = []
    try:
        for _ in range(2):
            with beam.Pipeline(options=local_options()) as p:
                sink = (
                    p
                    | beam.Create([*results, huge, {"user": None}])
                    | WriteToKafka(
                        bootstrap,
                        topic,
                        mode="exactly-once",
                        sink_group=group,
                        ledger_dsn=postgres.info["dsn"],
                        ledger_table="beam_kafka_ledger",
                        shards=3,
                        key_fn=lambda r: r["user"].encode(),  # fails for user None: a dead letter
                        value_fn=json.dumps,
                        id_fn=lambda r: r["user"],
                        batch_size=64,
                    )
                )
                reasons = sink.dead_letters | beam.Map(lambda d: (d.reason.split(":")[0], d.error))
                assert_that(
                    reasons,
                    equal_to(
                        [
                            ("too large for the broker", "MSG_SIZE_TOO_LARGE"),
                            ("cannot make a Kafka record", "AttributeError"),
                        ]
                    ),
                )
            written.append((_counter(p.result, "records_written"), _counter(p.result, "replays_skipped")))
    finally:
        close_shared_writers()
    assert written == [(300, 0), (0, 300)]
    expected = [json.dumps(r).encode() for r in results]
    assert exactly_once_problems(read_committed(bootstrap, topic), expected) == []


def test_kafka_to_kafka_replay_through_group_into_batches_writes_nothing(
    kafka: ServiceState, postgres: ServiceState, topic: str
) -> None:
    # ReadFromKafka's output is unbounded (even when the read stops at the end offsets), so this takes the streaming
    # path: GroupIntoBatches with its buffering timer. The second run reads everything again (a fresh group): a replay.
    bootstrap, source = kafka.info["bootstrap"], f"source-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, source, 2)
    produce(bootstrap, source, ((f"k{i}".encode(), f"event-{i}".encode()) for i in range(400)))
    group = f"k2k-{uuid.uuid4().hex[:6]}"
    written = []
    try:
        for _ in range(2):
            with beam.Pipeline(options=local_options()) as p:
                (
                    p
                    | ReadFromKafka(
                        bootstrap, [source], f"reader-{uuid.uuid4().hex[:6]}", stop=StopPolicy(at_end_offsets=True)
                    )
                    | beam.Map(lambda r: ProducerRecord(r.value, r.key, record_id=f"{r.partition}:{r.offset}"))
                    | WriteToKafka(
                        bootstrap,
                        topic,
                        mode="exactly-once",
                        sink_group=group,
                        ledger_dsn=postgres.info["dsn"],
                        ledger_table="beam_kafka_ledger",
                        shards=3,
                        batch_size=50,
                        max_buffering_s=0.5,
                    )
                )
            written.append((_counter(p.result, "records_written"), _counter(p.result, "replays_skipped")))
    finally:
        close_shared_writers()
    assert written == [(400, 0), (0, 400)]
    expected = [f"event-{i}".encode() for i in range(400)]
    assert exactly_once_problems(read_committed(bootstrap, topic), expected) == []


def test_at_least_once_writes_everything(kafka: ServiceState, topic: str) -> None:
    bootstrap = kafka.info["bootstrap"]
    values = [f"event-{i}".encode() for i in range(500)]
    with beam.Pipeline(options=local_options()) as p:
        sink = p | beam.Create(values) | WriteToKafka(bootstrap, topic, mode="at-least-once")
        total = sink.written | beam.Map(lambda r: r["rows_written"]) | beam.CombineGlobally(sum)
        assert_that(total, equal_to([500]))
    assert sorted(read_committed(bootstrap, topic)) == sorted(values)


def test_at_least_once_makes_records_in_the_writer_stamped_and_dead_letters_the_rest(
    kafka: ServiceState, topic: str
) -> None:
    # The at-least-once writer makes the records itself (no step of their own): each with its element's event time,
    # and an element that cannot become a record a dead letter with the reason, not a failed bundle.
    bootstrap = kafka.info["bootstrap"]
    elements = [{"u": f"user-{i}", "n": i} for i in range(20)] + [{"u": None, "n": 99}]
    with beam.Pipeline(options=local_options()) as p:
        sink = (
            p
            | beam.Create(elements)
            | beam.Map(lambda e: TimestampedValue(e, 1_700_000_000 + e["n"]))
            | WriteToKafka(
                bootstrap, topic, mode="at-least-once", key_fn=lambda e: e["u"].encode(), value_fn=lambda e: str(e["n"])
            )
        )
        reasons = sink.dead_letters | beam.Map(lambda d: (d.stage, d.error, d.reason.startswith("cannot make")))
        assert_that(reasons, equal_to([("write_to_kafka", "AttributeError", True)]), label="dead")
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"ts-{uuid.uuid4().hex[:6]}"})
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in consumer.list_topics(topic).topics[topic].partitions])
        stamps: dict[bytes, int] = {}
        deadline = time.monotonic() + 30
        while len(stamps) < 20 and time.monotonic() < deadline:
            for message in consumer.consume(100, 0.5):
                if message.error() is None:
                    stamps[message.key()] = message.timestamp()[1]
    finally:
        consumer.close()
    assert stamps == {f"user-{i}".encode(): (1_700_000_000 + i) * 1000 for i in range(20)}


def _stamps(bootstrap: str, topic: str, count: int) -> dict[bytes, int]:
    """key -> record timestamp (ms) of the first ``count`` committed records of ``topic``."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"ts-{uuid.uuid4().hex[:6]}", "isolation.level": "read_committed"}
    )
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in consumer.list_topics(topic).topics[topic].partitions])
        stamps: dict[bytes, int] = {}
        deadline = time.monotonic() + 30
        while len(stamps) < count and time.monotonic() < deadline:
            for message in consumer.consume(100, 0.5):
                if message.error() is None:
                    stamps[message.key()] = message.timestamp()[1]
        return stamps
    finally:
        consumer.close()


@pytest.mark.parametrize("mode", ["exactly-once", "at-least-once"])
def test_timestamps_the_broker_refuses_or_retention_would_delete_are_dead_letters(
    mode: str, kafka: ServiceState, postgres: ServiceState
) -> None:
    """A topic keeping one hour (``retention.ms``) on a broker refusing timestamps over an hour ahead (Kafka 4's
    default ``message.timestamp.after.max.ms``). Event-time stamps: a record two hours in the future would make the
    broker refuse its whole batch (before this check, every retry of the bundle failed: the pipeline failed); one two
    hours old would be deleted once its segment closed. Both become dead letters with their reason; the recent ones
    are written stamped with their event time. With ``timestamps="producer"`` all of them are written, stamped as
    produced."""
    bootstrap = kafka.info["bootstrap"]
    now_s = time.time()
    ages_s = {"recent": 600, "old": 2 * 3600, "future": -2 * 3600}
    elements = [(kind, i) for kind in ages_s for i in range(5)]
    for timestamps in ("event-time", "producer"):
        topic = f"stamps-{uuid.uuid4().hex[:8]}"
        create_topic(bootstrap, topic, 2, {"retention.ms": "3600000"})
        kwargs: dict[str, Any] = {"mode": mode, "timestamps": timestamps}
        if mode == "exactly-once":
            kwargs.update(sink_group=f"ts-{uuid.uuid4().hex[:6]}", ledger_dsn=postgres.info["dsn"], shards=2)
        try:
            with beam.Pipeline(options=local_options()) as p:
                sink = (
                    p
                    | beam.Create(elements)
                    | beam.Map(lambda e: TimestampedValue(e, now_s - ages_s[e[0]]))
                    | WriteToKafka(
                        bootstrap,
                        topic,
                        key_fn=lambda e: f"{e[0]}-{e[1]}".encode(),
                        value_fn=lambda e: e[0],
                        **kwargs,
                    )
                )
                dead = sink.dead_letters | beam.Map(lambda d: (d.key[:3], d.error, "retention.ms" in d.reason))
                expected = [(b"old", "TIMESTAMP_BEYOND_RETENTION", True)] * 5
                expected += [(b"fut", "INVALID_TIMESTAMP", False)] * 5
                assert_that(dead, equal_to(expected if timestamps == "event-time" else []))
        finally:
            close_shared_writers()
        if timestamps == "event-time":
            stamps = _stamps(bootstrap, topic, 5)
            assert set(stamps) == {f"recent-{i}".encode() for i in range(5)}
            assert all(abs(ms / 1000 - (now_s - 600)) < 1 for ms in stamps.values())
        else:
            stamps = _stamps(bootstrap, topic, 15)
            assert set(stamps) == {f"{kind}-{i}".encode() for kind, i in elements}
            assert all(now_s - 5 < ms / 1000 < time.time() + 5 for ms in stamps.values())  # stamped as produced


@pytest.mark.parametrize("mode", ["exactly-once", "at-least-once"])
def test_over_sasl_ssl_with_the_password_as_a_file_reference(
    mode: str, kafka: ServiceState, postgres: ServiceState, topic: str
) -> None:
    # The broker's SASL_SSL listener; the producer, the admin client and the marker reader all authenticate with the
    # settings given in producer_config, the password as a file: reference resolved on the worker.
    secure = dict(kafka.info["secure_client_config"])
    assert str(secure["sasl.password"]).startswith("file:")
    options: dict[str, Any] = {"mode": mode, "producer_config": secure}
    if mode == "exactly-once":
        options.update(sink_group=f"sasl-{uuid.uuid4().hex[:6]}", ledger_dsn=postgres.info["dsn"], shards=2)
    values = [f"secure-{i}".encode() for i in range(50)]
    try:
        with beam.Pipeline(options=local_options()) as p:
            p | beam.Create(values) | WriteToKafka(kafka.info["secure_bootstrap"], topic, **options)
    finally:
        close_shared_writers()
    assert exactly_once_problems(read_committed(kafka.info["bootstrap"], topic), values) == []


class _DeleteTopicOnce(beam.DoFn):
    """Deletes the topic before the first bundle: an at-least-once sink (same stage, opened before) then cannot
    deliver; an exactly-once writer (a stage after the shuffle, opened later) finds the topic gone."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._bootstrap, self._topic = bootstrap, topic

    def setup(self) -> None:
        self._deleted = False

    def start_bundle(self) -> None:
        if self._deleted:  # the first bundle deleted it
            return
        admin = AdminClient({"bootstrap.servers": self._bootstrap})
        for future in admin.delete_topics([self._topic]).values():
            future.result(30)
        self._deleted = True

    def process(self, element: Any) -> Iterator[Any]:
        yield element


@pytest.mark.parametrize("mode", ["at-least-once", "exactly-once"])
def test_a_delivery_failure_fails_the_pipeline(mode: str, kafka: ServiceState, postgres: ServiceState) -> None:
    bootstrap, topic = kafka.info["bootstrap"], f"doomed-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 1)
    options: dict[str, Any] = {"producer_config": {"message.timeout.ms": 3000}, "mode": mode}
    if mode == "exactly-once":
        options.update(sink_group=f"doomed-{uuid.uuid4().hex[:6]}", ledger_dsn=postgres.info["dsn"], shards=1)
    start = time.monotonic()
    try:
        with (
            pytest.raises(Exception, match=r"Message timed out|does not exist"),
            beam.Pipeline(options=local_options()) as p,
        ):
            (
                p
                | beam.Create([b"a", b"b", b"c"])
                | beam.ParDo(_DeleteTopicOnce(bootstrap, topic))
                | WriteToKafka(bootstrap, topic, **options)
            )
    finally:
        close_shared_writers()
    assert time.monotonic() - start < 60


def test_a_missing_topic_fails_the_pipeline(kafka: ServiceState) -> None:
    with (
        pytest.raises(Exception, match="cannot read its configuration"),
        beam.Pipeline(options=local_options()) as p,
    ):
        p | beam.Create([b"x"]) | WriteToKafka(kafka.info["bootstrap"], "no-such-topic", mode="at-least-once")


def test_the_at_least_once_engine_refuses_what_the_topic_would_refuse(kafka: ServiceState, topic: str) -> None:
    # The writer skips the full check for a record with no headers and no timestamp that is clearly small enough;
    # every other record goes through it. A record too large by its value, or only with its headers counted, and one
    # stamped beyond the broker's limit come back as dead letters; the others are written.
    bootstrap = kafka.info["bootstrap"]
    writer = AtLeastOnceWriter(bootstrap, topic, {"message.max.bytes": 20_000})
    assert writer.limit.max_bytes <= 20_000
    now_ms = int(time.time() * 1000)
    small = ProducerRecord(b"fits", key=b"k")
    too_big = ProducerRecord(b"v" * 30_000, key=b"k")
    big_by_headers = ProducerRecord(b"v" * 10_000, key=b"k", headers=(("h", b"x" * 15_000),))
    too_far_ahead = ProducerRecord(b"future", key=b"k", timestamp_ms=now_ms + 3 * 3600 * 1000)
    stamped = ProducerRecord(b"stamped", key=b"k")
    try:
        assert writer.add(small) == ()
        # Refused by the writer's own estimate, before the producer (whose refusal is the second line of defence).
        for record in (too_big, big_by_headers):
            assert [(d.error, d.reason.split(" bytes")[0]) for d in writer.add(record)] == [
                ("MSG_SIZE_TOO_LARGE", f"too large for the broker: record of about {record_size(record)}")
            ]
        assert [d.error for d in writer.add(too_far_ahead)] == ["INVALID_TIMESTAMP"]
        assert writer.add(stamped, now_ms) == ()
        assert writer.flush() == 2
        assert writer.stats.dead_letters == 3
    finally:
        writer.close()
    assert sorted(read_committed(bootstrap, topic)) == [b"fits", b"stamped"]


def test_the_engine_fails_on_delivery_errors(kafka: ServiceState, ledger: ShardLedger) -> None:
    bootstrap, topic = kafka.info["bootstrap"], f"gone-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 1)
    at_least_once = AtLeastOnceWriter(bootstrap, topic, {"message.timeout.ms": 2000})
    exactly_once = ExactlyOnceShardWriter(
        bootstrap, topic, f"gone-{uuid.uuid4().hex[:6]}", 0, ledger, {"message.timeout.ms": 2000}
    )
    exactly_once.write([ProducerRecord(b"before")])
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([topic]).values():
        future.result(30)
    at_least_once.add(ProducerRecord(b"x"))
    with pytest.raises(KafkaWriteError, match="Message timed out"):
        at_least_once.flush()
    with pytest.raises(KafkaWriteError, match=r"attempt 2 aborted: .* Message timed out"):
        exactly_once.write([ProducerRecord(b"y")])
    at_least_once.close()
    exactly_once.close()
