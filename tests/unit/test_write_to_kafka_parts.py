"""WriteToKafka's pure parts: record ids, shards, sizes, the refused configurations, elements -> records."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import MIN_TIMESTAMP

from beamflow.kafka.ledger import ledger_key
from beamflow.kafka.producer import (
    DEFAULT_PRODUCER_CONFIG,
    ProducerRecord,
    TopicLimits,
    build_producer_config,
    check_producer_config,
    record_size,
    shard_of,
)
from runners.direct import local_options
from transforms.sink_base import DEAD_LETTERS
from transforms.write_to_kafka import WriteToKafka, _chunks, _RecordMaker, _ToShardedRecord, _TransactionalFn

DSN = "postgresql://postgres@127.0.0.1:5432/beamflow"


def test_record_ids_are_deterministic_and_unambiguous() -> None:
    assert ProducerRecord(b"v", b"k").identity() == ProducerRecord(b"v", b"k").identity()
    assert ProducerRecord(b"bc", b"a").identity() != ProducerRecord(b"c", b"ab").identity()  # lengths are hashed
    assert ProducerRecord(b"v", None).identity() != ProducerRecord(b"v", b"").identity()
    assert (
        ProducerRecord(b"v", headers=(("h", b"ab"),)).identity()
        != ProducerRecord(b"v", headers=(("ha", b"b"),)).identity()
    )
    assert ProducerRecord(b"v", record_id="r1").identity() == "r1"


def test_shards_follow_the_key_and_stay_in_range() -> None:
    records = [ProducerRecord(f"v{i}".encode(), f"k{i % 10}".encode()) for i in range(1000)]
    shards = [shard_of(r, 4) for r in records]
    assert set(shards) == {0, 1, 2, 3}
    by_key: dict[bytes | None, set[int]] = {}
    for record, shard in zip(records, shards, strict=True):
        by_key.setdefault(record.key, set()).add(shard)
    assert all(len(s) == 1 for s in by_key.values())  # one key, one shard
    unkeyed = ProducerRecord(b"x", record_id="id-1")
    assert shard_of(unkeyed, 7) == shard_of(ProducerRecord(b"other", record_id="id-1"), 7)  # by id without a key


def test_size_limit_splits_off_records_too_large() -> None:
    limit = TopicLimits(1000, "write_to_kafka")
    small, big = ProducerRecord(b"x" * 100, b"k"), ProducerRecord(b"x" * 1000, b"k", record_id="big")
    assert record_size(small) < 1000 < record_size(big)
    fit, dead = limit.split([small, big])
    assert fit == [small]
    assert [(d.error, d.reason.startswith("too large for the broker"), dict(d.attributes)) for d in dead] == [
        ("MSG_SIZE_TOO_LARGE", True, {"record_id": "big"})
    ]


def test_topic_limits_refuse_timestamps_the_broker_refuses_or_retention_would_delete() -> None:
    now_ms = 1_800_000_000_000
    limits = TopicLimits(
        10_000, "write_to_kafka", before_max_ms=30 * 86_400_000, after_max_ms=3_600_000, retention_ms=86_400_000
    )
    limits.clock = lambda: now_ms / 1000

    def verdict(age_ms: int | None) -> str | None:
        stamp = None if age_ms is None else now_ms - age_ms
        dead = limits.refuse(ProducerRecord(b"v", b"k", timestamp_ms=stamp), stamp)
        return None if dead is None else dead.error

    assert verdict(None) is None  # the producer stamps it: nothing to check
    assert verdict(0) is None
    assert verdict(-3_600_000) is None  # exactly the broker's limit ahead
    assert verdict(-3_600_001) == "INVALID_TIMESTAMP"
    assert verdict(86_400_000) is None  # exactly the retention: expires on schedule, like any record
    assert verdict(86_400_001) == "TIMESTAMP_BEYOND_RETENTION"
    assert verdict(30 * 86_400_000 + 1) == "INVALID_TIMESTAMP"  # the broker would refuse it before retention matters
    fit, dead = limits.split(
        [ProducerRecord(b"a", timestamp_ms=now_ms), ProducerRecord(b"b", timestamp_ms=now_ms + 7_200_000)]
    )
    assert [r.value for r in fit] == [b"a"]
    assert [(d.payload, d.error, "after.max.ms" in d.reason) for d in dead] == [(b"b", "INVALID_TIMESTAMP", True)]
    unlimited = TopicLimits(10_000, "write_to_kafka")  # LogAppendTime, or no limits: only the size counts
    assert unlimited.refuse(ProducerRecord(b"v", timestamp_ms=1), 1) is None


def test_producer_timestamps_leave_the_event_time_out() -> None:
    make = _RecordMaker(None, lambda e: e, None, event_time=False)
    assert make(b"x", 1_700_000_000_000_000)[1] is None  # the producer stamps it
    own = _RecordMaker(None, None, None, event_time=False)
    assert own(ProducerRecord(b"y", timestamp_ms=5), 1_700_000_000_000_000)[1] == 5  # the record's own stays
    assert _RecordMaker(None, lambda e: e, None)(b"x", 1_700_000_000_000_000)[1] == 1_700_000_000_000
    with pytest.raises(ValueError, match="timestamps must be one of"):
        WriteToKafka("b:9092", "t", mode="at-least-once", timestamps="log-append")


def test_seed_002_producer_defaults_are_overridable_but_the_guarantee_is_not() -> None:
    assert DEFAULT_PRODUCER_CONFIG["batch.size"] == 128 * 1024
    assert 50 <= DEFAULT_PRODUCER_CONFIG["linger.ms"] <= 100
    assert DEFAULT_PRODUCER_CONFIG["compression.type"] == "lz4"
    config = build_producer_config("b:9092", {"linger.ms": 5, "compression.type": "zstd", "batch.size": 1})
    assert (config["linger.ms"], config["compression.type"], config["batch.size"]) == (5, "zstd", 1)
    assert (config["acks"], config["enable.idempotence"]) == ("all", True)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"transactional.id": "x"}, "transactional.id"),
        ({"enable.idempotence": False}, "enable.idempotence"),
        ({"acks": 1}, "acks=1"),
        ({"isolation.level": "read_committed"}, "isolation.level"),
    ],
)
def test_unsafe_producer_settings_are_refused(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_producer_config(config, exactly_once=True)
    with pytest.raises(ValueError, match=message):
        WriteToKafka(
            "b:9092", "t", mode="exactly-once", sink_group="g", ledger_dsn=DSN, shards=1, producer_config=config
        )


def test_acks_all_and_idempotence_may_be_restated() -> None:
    check_producer_config({"acks": "all", "enable.idempotence": True}, exactly_once=True)
    check_producer_config({"acks": -1, "enable.idempotence": "true"}, exactly_once=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "exactly-twice"}, "mode must be one of"),
        ({"mode": "exactly-once"}, "needs sink_group=, ledger_dsn= and shards="),
        ({"mode": "exactly-once", "sink_group": "g", "ledger_dsn": DSN}, "needs sink_group="),
        ({"mode": "exactly-once", "sink_group": "g", "ledger_dsn": DSN, "shards": -1}, "shards must be >= 1"),
        (
            {"mode": "exactly-once", "sink_group": "g", "ledger_dsn": DSN, "shards": 2, "ledger_retention_s": 60},
            "would be written again",
        ),
        ({"mode": "exactly-once", "sink_group": "g", "ledger_dsn": DSN, "shards": 2, "batch_size": 0}, "batch_size"),
        (
            {"mode": "exactly-once", "sink_group": "g", "ledger_dsn": DSN, "shards": 2, "ledger_table": "x;y"},
            "invalid ledger table",
        ),
        ({"mode": "at-least-once", "sink_group": "g"}, "takes no sink_group"),
        ({"mode": "at-least-once", "shards": 3}, "takes no sink_group"),
    ],
)
def test_configurations_that_cannot_be_safe_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        WriteToKafka("b:9092", "t", **kwargs)
    assert "\n" not in str(raised.value)  # one line


def test_elements_become_records_with_their_event_time_or_dead_letters() -> None:
    def describe(sharded: tuple[int, tuple[Any, ...]]) -> tuple[Any, ...]:
        shard, (value, key, _headers, record_id, timestamp_ms) = sharded
        assert 0 <= shard < 3
        return (key, value, record_id, timestamp_ms)

    with beam.Pipeline(options=local_options()) as p:
        elements = (
            p | beam.Create([{"u": "a", "n": 1}, {"u": None, "n": 2}]) | beam.Map(lambda e: TimestampedValue(e, 12.5))
        )
        out = elements | beam.ParDo(
            _ToShardedRecord(
                _RecordMaker(lambda e: e["u"].encode(), lambda e: str(e["n"]), lambda e: f"id-{e['n']}"), 3
            )
        ).with_outputs(DEAD_LETTERS, main="records")
        assert_that(out.records | beam.Map(describe), equal_to([(b"a", b"1", "id-1", 12500)]), label="records")
        reasons = out[DEAD_LETTERS] | beam.Map(lambda d: (d.stage, d.error, d.reason.startswith("cannot make")))
        assert_that(reasons, equal_to([("write_to_kafka", "AttributeError", True)]), label="dead")
        given = p | "Given" >> beam.Create([ProducerRecord(b"v", b"k", record_id="r")])
        passed = given | "Pass" >> beam.ParDo(_ToShardedRecord(_RecordMaker(None, None, None), 3)).with_outputs(
            DEAD_LETTERS, main="records"
        )
        assert_that(
            passed.records | "Describe" >> beam.Map(describe), equal_to([(b"k", b"v", "r", None)]), label="as is"
        )


def test_a_shard_group_is_cut_into_transactions_of_batch_size_lazily() -> None:
    def records() -> Iterator[tuple[Any, ...]]:
        for i in range(2500):
            yield (f"v{i}".encode(), None, (), None, None)

    chunks = list(_chunks((3, records()), 1000))
    assert [(shard, len(chunk)) for shard, chunk in chunks] == [(3, 1000), (3, 1000), (3, 500)]
    assert [r[0] for _, chunk in chunks for r in chunk] == [f"v{i}".encode() for i in range(2500)]  # order kept


def test_ledger_keys_are_fixed_size_digests_of_the_record_id() -> None:
    assert ledger_key("a") == ledger_key("a") != ledger_key("b")
    assert len(ledger_key("x" * 10_000)) == len(ledger_key("")) == 32


class _GatedWrites(_TransactionalFn):
    """The exactly-once DoFn with its Kafka and ledger work replaced by writes that wait for a gate per shard."""

    def __init__(self, max_in_flight_bytes: int) -> None:
        super().__init__("b", "t", "g", DSN, "ledger", 4, {}, 3600.0, 10.0, max_in_flight_bytes)
        self._threads, self._pending, self._in_flight_bytes = {}, [], 0
        self.gates = {shard: threading.Event() for shard in range(4)}
        self.started: list[int] = []

    def _write(self, shard: int, batch: list[ProducerRecord]) -> tuple[int, int, int, list[Any]]:
        self.started.append(shard)
        assert self.gates[shard].wait(10)
        return shard, len(batch), 0, []


def _batch(n: int) -> list[tuple[Any, ...]]:
    return [(b"x" * 100, None, (), None, None)] * n  # 100 bytes each


def test_bounded_input_writes_the_next_shards_while_the_first_is_still_written() -> None:
    # Bounded input arrives one shard's whole group after another: a bound counted in batches would hold the second
    # shard back until the first was nearly written. Counted in bytes, every shard is under way at once.
    fn = _GatedWrites(max_in_flight_bytes=1_000_000)
    for shard in range(4):
        for _ in range(3):
            assert fn.add((shard, _batch(10))) == []  # 12 batches of 1,000 bytes: all in flight, none waited for
    deadline = time.monotonic() + 10
    while len(set(fn.started)) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(set(fn.started)) == [0, 1, 2, 3]
    for gate in fn.gates.values():
        gate.set()
    reports = [out for out in fn.flush() if isinstance(out, dict)]
    assert sum(r["rows_written"] for r in reports) == 120
    fn.close()


def test_the_bytes_in_flight_are_bounded() -> None:
    fn = _GatedWrites(max_in_flight_bytes=2_500)  # two batches of 1,000 bytes fit, a third does not
    fn.add((0, _batch(10)))
    fn.add((1, _batch(10)))
    third = threading.Thread(target=fn.add, args=((2, _batch(10)),))
    third.start()
    third.join(0.5)
    assert third.is_alive()  # over the bound: add waits for the oldest write
    fn.gates[0].set()
    third.join(10)
    assert not third.is_alive() and fn._in_flight_bytes == 2_000
    fn.gates[1].set()
    fn.gates[2].set()
    assert sum(r["rows_written"] for r in fn.flush() if isinstance(r, dict)) == 20  # the oldest was collected by add
    fn.close()


def test_a_record_element_is_written_as_it_is_with_its_timestamp_beside_it() -> None:
    make = _RecordMaker(None, None, None)
    given = ProducerRecord(b"v", b"k")
    record, timestamp_ms = make(given, 12_500_000)
    assert record is given and timestamp_ms == 12_500  # no copy per element: the event time travels beside it
    assert make(given, MIN_TIMESTAMP.micros) == (given, None)  # Beam's min: librdkafka stamps it
    stamped = ProducerRecord(b"v", b"k", timestamp_ms=7)
    assert make(stamped, 12_500_000) == (stamped, 7)  # the record's own timestamp wins
    with_id, _ = _RecordMaker(None, None, lambda r: f"id-{r.value.decode()}")(given, 0)
    assert (with_id.value, with_id.key, with_id.record_id) == (b"v", b"k", "id-v")
