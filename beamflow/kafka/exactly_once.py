"""Writing records to Kafka exactly-once: one Kafka transaction per call, fenced through a PostgreSQL ledger
(``beamflow.kafka.ledger``). No Beam.

Exactly-once, and why this design (the research note ``kafka-sink-and-enrichment.md`` has the sources):

- librdkafka cannot resume or commit a prepared transaction from another producer instance (``init_transactions`` on
  the same ``transactional.id`` *aborts* it), so Flink's design (pre-commit at the barrier, commit after the
  checkpoint) would lose a prepared transaction whose process died; and Beam's Flink runner finalizes bundles from an
  in-memory list, also bundles that ran after the barrier. No transaction may outlive the call that began it.
- Beam Java's design (sequence numbers per shard, a marker committed with the transaction) needs stable input: a
  replay must carry the same sequence numbers. Beam Python 2.62 cannot ask for stable input, so a replayed bundle may
  hold a different set of records in a different order.

So each call of ``ExactlyOnceShardWriter.write`` is one transaction of one shard, committed before it returns, and a
replay is recognised by the records' **ids** (deterministic per result), kept in a PostgreSQL ledger:

1. PostgreSQL (one transaction, the shard's row locked): resolve a pending attempt left by a crash (below); drop the
   records whose ids the ledger holds as written; record the new ids under attempt ``n + 1``; mark the shard pending.
2. Kafka: ``begin_transaction``, produce, ``send_offsets_to_transaction`` with the marker ``{attempt: n + 1}`` on
   ``TopicPartition(topic, shard)`` of the sink's group (atomically with the records), ``commit_transaction``.
3. PostgreSQL: clear the pending mark of attempt ``n + 1`` and record it as the shard's last committed attempt: in
   the writer's next claim (step 1 of its next write, one transaction fewer per batch) or when it closes. Until then
   the attempt looks pending, and another writer decides it like any pending attempt (below): committed.

A pending attempt ``n`` found in step 1 is decided by the Kafka marker ``m`` (read with ``require_stable``, so a commit
in progress is waited for): ``m >= n`` means attempt ``n`` committed (keep its ids). Otherwise it is declared aborted
(its ids no longer count as written; the runner replays its records) only after this writer has committed a *probe*
transaction (the marker rewritten unchanged): a commit under this producer's epoch proves that every older producer of
the shard's ``transactional.id`` is fenced, so attempt ``n`` can no longer commit; and a newer producer would have
fenced the probe, which then fails (``ShardFenced``) and nothing is decided. (Deciding on "this writer has just run
``init_transactions``" alone is not enough: with two live writers, the other one may have initialised later, hold the
newer epoch, and commit attempt ``n`` after the marker was read.)

The three hard moments: a crash mid-transaction leaves the shard pending and the transaction open; the next writer's
``init_transactions`` aborts it, the marker says "not committed", its ids no longer count as written and the
replay writes the records. A crash after the commit (before the checkpoint, or before step 3) leaves ids the ledger
keeps: the replay skips them. A commit after the checkpoint does not exist here: every transaction commits inside
its bundle.

Refused, because they cannot be made safe: a shard number >= the topic's partition count (the marker lives on the
partition numbered like the shard; Kafka refuses an offset commit for a partition that does not exist); a sink group
already used for another topic (its transactional ids and markers would be shared); a marker older than the last
attempt the ledger knows committed (the sink group's offsets expired, ``offsets.retention.minutes``, or were reset:
a pending attempt could no longer be decided); a marker newer than the ledger (the ledger was dropped or is another
one); producer settings that break the guarantee (``transactional.id``, ``enable.idempotence=false``, ``acks`` other
than ``all``).

Zombies: a second instance of a shard's writer bumps the producer epoch, so the first one's next Kafka call fails
(``ShardFenced``), and a writer that finds the shard's attempt moved by another writer refuses that write
(``ShardFenced``). Either way the fenced writer drops its producer: a retry of its bundle starts over with
``init_transactions`` (fencing the other in turn) instead of failing forever."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from beamflow.deadletter import DeadLetter
from beamflow.kafka.admin import connection_config, topic_partition_count
from beamflow.kafka.ledger import ShardLedger, ledger_key
from beamflow.kafka.producer import (
    KafkaWriteError,
    ProducerRecord,
    RecordTooLarge,
    ShardFenced,
    TopicLimits,
    WriterStats,
    build_producer_config,
    check_producer_config,
    fetch_topic_limits,
    produce_record,
)
from beamflow.postgres.arrays import text_array

__all__ = ["ExactlyOnceShardWriter"]

log = logging.getLogger(__name__)

# A failed transaction is aborted briefly and the producer dropped either way: the next init_transactions aborts
# whatever this abort did not.
_ABORT_TIMEOUT_S = 10.0


@dataclass
class _Claim:
    attempt: int
    new: list[ProducerRecord] = field(default_factory=list)
    skipped: int = 0


def _kafka_error_of(exc: BaseException) -> Any:
    """The KafkaError behind ``exc`` (itself, or the KafkaException it was raised from), else None."""
    from confluent_kafka import KafkaException

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KafkaException) and seen.args:
            return seen.args[0]
        seen = seen.__cause__ or seen.__context__
    return None


def _is_fenced(error: Any) -> bool:
    """A newer producer of the same transactional id exists (this one can never write again)."""
    from confluent_kafka import KafkaError

    fenced = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)
    return error is not None and error.code() in fenced


class ExactlyOnceShardWriter:
    """Writes batches of one shard's records in Kafka transactions, skipping ids already written (module docstring).

    ``write(records)`` returns (records written, dead letters); it raises ``KafkaWriteError`` (or ``ShardFenced``)
    when nothing may be assumed written: the caller's bundle must fail and be retried. One writer per shard per
    process; calls must not overlap (the caller serialises them).
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        sink_group: str,
        shard: int,
        ledger: ShardLedger,
        producer_config: dict[str, Any] | None = None,
        timeout_s: float = 60.0,
        stage: str = "write_to_kafka",
        limits: TopicLimits | None = None,
        partitions: int | None = None,
    ) -> None:
        overrides = dict(producer_config or {})
        check_producer_config(overrides, exactly_once=True)
        if partitions is None:
            partitions = topic_partition_count(bootstrap, topic, config=overrides)
        if not 0 <= shard < partitions:
            raise ValueError(
                f"shard {shard} needs partition {shard} of topic {topic}, which has {partitions}: shards must be "
                "<= the topic's partitions (each shard's commit marker is an offset on its own partition)"
            )
        self.bootstrap = bootstrap
        self.topic = topic
        self.sink_group = sink_group
        self.shard = shard
        self.ledger = ledger
        self.transactional_id = f"{sink_group}-{shard}"
        self.timeout_s = timeout_s
        self.config = {**build_producer_config(bootstrap, overrides), "transactional.id": self.transactional_id}
        self.config.setdefault("transaction.timeout.ms", 60_000)
        self.limit = limits or fetch_topic_limits(bootstrap, topic, self.config, stage)
        self.stats = WriterStats()
        self._producer: Any = None
        self._marker_reader: Any = None
        self._group_metadata: Any = None
        self._last_attempt: int | None = None  # the shard's attempt as this writer last left it
        # ``_last_attempt`` committed in Kafka, its pending mark still set: the next claim clears it in its own
        # transaction (``_claim``), which saves a PostgreSQL transaction per batch; ``close`` clears a last one.
        self._unsettled = False
        self._checked = False  # the marker was compared with the ledger since this producer started
        self._errors: list[str] = []
        self._fatal: Any = None  # librdkafka's fatal error of the current producer, reported through error_cb
        self._next_prune = 0.0

    # ---- hooks for fault-injection tests (no-ops) -------------------------------------------------------------

    def _phase(self, name: str) -> None:
        """Called at each step of a write ("claimed", "produced", "committed", "done"); tests kill the process here."""

    def _claim_ids(self, conn: Any, keys: list[str], attempt: int) -> list[str]:
        """Records under ``attempt`` those of ``keys`` the ledger does not hold as written (absent, or held under an
        aborted attempt); if any, registers the attempt and marks the shard pending with it. Returns the others, the
        replays: usually none, so the answer is one NULL, not a row per new key for the client to read (a tenth of the
        claim's client time at 1,000 keys). One statement, one round trip.

        The ids are looked up first and the new ones inserted plainly: ``INSERT ... ON CONFLICT DO NOTHING`` costs
        about twice a plain insert per row (a speculative insertion: an extra index probe and WAL record). No other
        writer inserts the same ids meanwhile: a shard's claims hold its row lock (``_claim``), and a result's shard
        is a hash of its key (else its id). Were it to happen anyway (an ``id_fn`` giving one id to results with
        different keys), the insert fails on the primary key and the bundle is retried, never skipped. (A test
        overrides this to break the sink.)"""
        table = self.ledger.table
        row = conn.execute(
            f"WITH found AS (SELECT r.record_key, a.aborted IS NOT NULL AS stale FROM {table} AS r "
            f"LEFT JOIN {table}_attempts AS a ON a.sink_group = r.sink_group AND a.shard = r.shard "
            "AND a.attempt = r.attempt AND a.aborted "
            "WHERE r.sink_group = %(group)s AND r.record_key = ANY(%(keys)s::text[])), "
            f"new AS (INSERT INTO {table} (sink_group, record_key, shard, attempt) "
            "SELECT %(group)s, k, %(shard)s, %(attempt)s FROM unnest(%(keys)s::text[]) AS k "
            "WHERE k NOT IN (SELECT record_key FROM found) RETURNING 1), "
            f"retaken AS (UPDATE {table} SET shard = %(shard)s, attempt = %(attempt)s WHERE sink_group = %(group)s "
            "AND record_key IN (SELECT record_key FROM found WHERE stale) RETURNING 1), "
            f"registered AS (INSERT INTO {table}_attempts (sink_group, shard, attempt) "
            "SELECT %(group)s, %(shard)s, %(attempt)s WHERE EXISTS (SELECT 1 FROM new) "
            "OR EXISTS (SELECT 1 FROM retaken)), "
            f"pending AS (UPDATE {table}_shards SET attempt = %(attempt)s, pending = true "
            "WHERE sink_group = %(group)s AND shard = %(shard)s "
            "AND (EXISTS (SELECT 1 FROM new) OR EXISTS (SELECT 1 FROM retaken))) "
            "SELECT array_agg(record_key) FROM found WHERE NOT stale",
            {"group": self.sink_group, "shard": self.shard, "attempt": attempt, "keys": text_array(keys)},
        ).fetchone()
        return list(row[0]) if row and row[0] else []

    # ---- the producer -----------------------------------------------------------------------------------------

    def _ensure_producer(self) -> Any:
        if self._producer is None:
            from confluent_kafka import Consumer, KafkaException, Producer

            self._fatal = None
            producer = Producer({**self.config, "error_cb": self._on_client_error})
            try:
                # Fences every older instance on this id and aborts (or waits for) its open transaction.
                producer.init_transactions(self.timeout_s)
            except KafkaException as exc:
                producer.close()
                raise KafkaWriteError(f"shard {self.shard}: init_transactions failed ({exc})") from exc
            if self._marker_reader is None:
                # Never subscribes: its group metadata (generation -1, no member id) is what Java's
                # ConsumerGroupMetadata(groupId) gives, accepted by send_offsets_to_transaction (tested).
                self._marker_reader = Consumer(
                    {
                        **connection_config(self.bootstrap, self.config),
                        "group.id": self.sink_group,
                        "enable.auto.commit": False,
                        "isolation.level": "read_committed",  # committed() waits for a commit in progress
                    }
                )
                self._group_metadata = self._marker_reader.consumer_group_metadata()
            self._producer = producer
            self._checked = False
        return self._producer

    def _on_client_error(self, error: Any) -> None:
        """librdkafka's error callback. A fatal error (fencing among them) ends the producer for good; librdkafka
        reports it here (confluent-kafka hands over ``rd_kafka_fatal_error``'s code) whichever call then fails and
        however that call's failure reaches Python."""
        if error.fatal():
            self._fatal = error
        user_callback = self.config.get("error_cb")
        if callable(user_callback):
            user_callback(error)

    def _is_fenced(self, exc: BaseException) -> bool:
        """The one answer to "was this producer fenced?": the failed call's own error, or the producer's fatal error.

        The second matters because a fatal error raised while ``flush()`` serves delivery callbacks reaches Python
        in more than one shape: a ``SystemError`` whose context is the ``KafkaException``, or (seen in full CI runs)
        a ``SystemError`` "returned NULL without setting an exception" with every queued record purged and no
        fatal error reported through ``error_cb`` yet: then the producer's own transactional API is asked.
        """
        error = _kafka_error_of(exc)
        if _is_fenced(error) or _is_fenced(self._fatal):
            return True
        if error is None and self._producer is not None:
            # No Kafka error reached Python (the NULL shape): ask librdkafka.
            self._abort_or_learn_fatal()
            return _is_fenced(self._fatal)
        return False

    def _abort_or_learn_fatal(self) -> None:
        """Aborts the open transaction; a producer in its fatal state answers with that fatal error instead, which
        is kept. (A live producer's abort is what the failed write does anyway before the producer is dropped.)"""
        from confluent_kafka import KafkaException

        try:
            self._producer.abort_transaction(_ABORT_TIMEOUT_S)
        except KafkaException as probe:
            answer = _kafka_error_of(probe)
            if answer is not None and answer.fatal():
                self._fatal = answer

    def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            # A fenced producer refuses (and warns that close could not abort): it is being thrown away, and the
            # next init_transactions on its id aborts whatever it left open.
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                producer.purge()  # nothing queued may be waited for: whatever it held is replayed or aborted
                producer.close()

    def marker(self) -> int:
        """The last attempt whose transaction committed (0: none), from the sink group's marker."""
        from confluent_kafka import KafkaException, TopicPartition

        try:
            found = self._marker_reader.committed([TopicPartition(self.topic, self.shard)], timeout=self.timeout_s)
        except KafkaException as exc:
            raise KafkaWriteError(f"shard {self.shard}: cannot read the commit marker ({exc})") from exc
        meta = found[0].metadata if found and found[0].offset >= 0 else None
        if not meta:
            return 0
        parsed = json.loads(meta)
        if parsed.get("sink_group") != self.sink_group or parsed.get("shard") != self.shard:
            raise KafkaWriteError(f"shard {self.shard}: the marker belongs to another sink ({meta}); refusing")
        return int(parsed["attempt"])

    def _send_marker(self, attempt: int) -> None:
        from confluent_kafka import TopicPartition

        marker = json.dumps({"sink_group": self.sink_group, "shard": self.shard, "attempt": attempt})
        self._producer.send_offsets_to_transaction(
            [TopicPartition(self.topic, self.shard, attempt, metadata=marker)], self._group_metadata, self.timeout_s
        )

    def _probe(self, marker: int) -> None:
        """Commits a transaction of the marker alone, unchanged: succeeds only under the newest producer epoch."""
        from confluent_kafka import KafkaException

        producer = self._producer
        try:
            producer.begin_transaction()
            self._send_marker(marker)
            producer.commit_transaction(self.timeout_s)
        except (KafkaException, SystemError) as exc:
            if self._is_fenced(exc):
                raise ShardFenced(
                    f"shard {self.shard}: fenced by a newer writer while deciding a pending attempt"
                ) from exc
            raise KafkaWriteError(f"shard {self.shard}: the fencing probe failed ({exc})") from exc

    # ---- one write --------------------------------------------------------------------------------------------

    def write(self, records: Sequence[ProducerRecord]) -> tuple[int, list[DeadLetter]]:
        fit, dead = self.limit.split(records)
        self.stats.dead_letters += len(dead)
        if not fit:
            return 0, dead
        try:
            self._ensure_producer()
            claim = self._claim(fit)
        except ShardFenced:
            self._fenced()
            raise
        except Exception:
            self._drop_producer()  # the next write starts with init_transactions and a fresh look at the marker
            raise
        self._phase("claimed")
        self.stats.skipped_replays += claim.skipped
        if not claim.new:
            return 0, dead
        try:
            too_large = self._transaction(claim)
        except ShardFenced:
            self._fenced()
            raise
        except Exception:
            self._drop_producer()
            raise
        self._phase("committed")
        if too_large:
            self._settle(claim.attempt, too_large)
        else:
            self._unsettled = True
        self._phase("done")
        self.stats.written += len(claim.new) - len(too_large)
        self.stats.dead_letters += len(too_large)
        if time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + self.ledger.prune_every_s
            self.ledger.prune(self.sink_group)
        return len(claim.new) - len(too_large), dead + too_large

    def _fenced(self) -> None:
        # Not wedged: the bundle fails now; its retry starts over with init_transactions (which fences the other
        # writer in turn) and the shard's current attempt.
        self.stats.fenced += 1
        self._drop_producer()
        self._last_attempt = None
        self._unsettled = False  # the other writer decides it from the marker

    def _claim(self, records: list[ProducerRecord]) -> _Claim:
        """Step 1 (see the module docstring), in one PostgreSQL transaction with the shard's row locked."""
        ledger, table = self.ledger, self.ledger.table
        ledger.create()
        by_key: dict[str, ProducerRecord] = {}
        for record in records:
            by_key.setdefault(ledger_key(record.identity()), record)  # the same result twice in a batch is one
        # Pipeline mode: BEGIN goes with the first statement and COMMIT with nothing to wait for, so a claim with
        # nothing pending costs three round trips (the shard's row, the ids, the commit).
        with ledger.pool.connection() as conn, conn.pipeline(), conn.transaction():
            # Creates the shard's row if missing, locks it either way (DO UPDATE takes the row lock, as SELECT ...
            # FOR UPDATE would) and returns it.
            row = conn.execute(
                f"INSERT INTO {table}_shards AS s (sink_group, shard, topic, attempt, pending, committed) "
                "VALUES (%s, %s, %s, 0, false, 0) ON CONFLICT (sink_group, shard) DO UPDATE SET attempt = s.attempt "
                "RETURNING topic, attempt, pending, committed",
                (self.sink_group, self.shard, self.topic),
            ).fetchone()
            assert row is not None
            topic, attempt, pending, committed = str(row[0]), int(row[1]), bool(row[2]), int(row[3])
            if topic != self.topic:
                raise ValueError(
                    f"sink group {self.sink_group} writes topic {topic}, not {self.topic}: one sink group per sink "
                    "(two topics would share transactional ids and commit markers)"
                )
            if self._last_attempt is not None and attempt != self._last_attempt:
                raise ShardFenced(
                    f"shard {self.shard} of sink group {self.sink_group} was taken over (attempt {attempt}, this "
                    f"writer's last was {self._last_attempt}): this instance is a zombie"
                )
            if pending and self._unsettled:
                # Step 3 of this writer's last write (``_settle``), done here: it committed that attempt itself, so
                # nothing needs asking. The check above made sure the shard's attempt is still that one (attempt
                # numbers are never reused, so it cannot be another writer's).
                conn.execute(
                    f"UPDATE {table}_shards SET pending = false, committed = %s WHERE sink_group = %s AND shard = %s",
                    (attempt, self.sink_group, self.shard),
                )
                pending, committed = False, attempt
            self._unsettled = False
            if not self._checked:
                marker = self.marker()
                if marker > attempt:
                    raise KafkaWriteError(
                        f"shard {self.shard}: the Kafka marker is at attempt {marker} but ledger {table} only at "
                        f"{attempt}: the ledger was dropped or is another one; refusing (replays would duplicate)"
                    )
                self._checked = True
            if pending:
                self._resolve(conn, attempt, committed)
            replayed = set(self._claim_ids(conn, list(by_key), attempt + 1))
            fresh = len(by_key) - len(replayed)
            claim = _Claim(attempt + 1 if fresh else attempt, skipped=len(records) - fresh)
            # In the batch's order.
            claim.new = [r for k, r in by_key.items() if k not in replayed] if replayed else list(by_key.values())
        self._last_attempt = claim.attempt
        return claim

    def _resolve(self, conn: Any, attempt: int, committed: int) -> None:
        """Decides the shard's pending ``attempt`` (left by a crash, a failed write or another writer)."""
        table = self.ledger.table
        marker = self.marker()
        if marker >= attempt:
            self.stats.recovered_committed += 1
            log.info("shard %s: pending attempt %s had committed; its ids stay", self.shard, attempt)
            conn.execute(
                f"UPDATE {table}_shards SET pending = false, committed = %s WHERE sink_group = %s AND shard = %s",
                (attempt, self.sink_group, self.shard),
            )
            return
        if marker < committed:
            raise KafkaWriteError(
                f"shard {self.shard}: the Kafka marker says attempt {marker} but the ledger knows {committed} "
                "committed: the sink group's offsets expired (offsets.retention.minutes) or were reset; refusing to "
                f"decide pending attempt {attempt} (keep the offsets retention longer than any outage)"
            )
        self._probe(marker)  # from here on, attempt `attempt` cannot commit any more
        self.stats.recovered_aborted += 1
        log.info("shard %s: pending attempt %s was aborted; its ids count as new again", self.shard, attempt)
        # Marked, not deleted (``ShardLedger``): a claim takes an id held under an aborted attempt as new.
        conn.execute(
            f"INSERT INTO {table}_attempts (sink_group, shard, attempt, aborted) VALUES (%s, %s, %s, true) "
            "ON CONFLICT (sink_group, shard, attempt) DO UPDATE SET aborted = true",
            (self.sink_group, self.shard, attempt),
        )
        conn.execute(
            f"UPDATE {table}_shards SET pending = false WHERE sink_group = %s AND shard = %s",
            (self.sink_group, self.shard),
        )

    def _transaction(self, claim: _Claim) -> list[DeadLetter]:
        """Step 2: the records and the marker in one Kafka transaction, committed before returning. Returns the dead
        letters of records the producer itself refused as too large (the size estimate let them through)."""
        from confluent_kafka import KafkaException

        producer = self._producer
        self._errors = []
        too_large: list[DeadLetter] = []
        try:
            producer.begin_transaction()
            for record in claim.new:
                try:
                    produce_record(producer, self.topic, record, self._delivered)
                except RecordTooLarge as exc:  # still the record's fault, not Kafka's
                    too_large.append(self.limit.too_large(record, str(exc)))
            self._phase("produced")
            # commit_transaction would flush too; flushing first fails fast on delivery errors, before the marker
            # (whose offset commit on a vanished partition would retry until the timeout).
            remaining = producer.flush(self.timeout_s)
            if remaining or self._errors:
                self._abort_or_learn_fatal()
                if _is_fenced(self._fatal):  # the delivery errors are the purge that ends a fenced producer
                    raise ShardFenced(
                        f"shard {self.shard}: fenced by a newer writer of {self.transactional_id}; attempt "
                        f"{claim.attempt} is not written"
                    )
                raise KafkaWriteError(
                    f"shard {self.shard}: attempt {claim.attempt} aborted: {remaining} records unacked, "
                    f"delivery errors: {self._errors[:3]}"
                )
            self._send_marker(claim.attempt)
            producer.commit_transaction(self.timeout_s)
        except (KafkaException, SystemError) as exc:
            if self._is_fenced(exc):
                raise ShardFenced(
                    f"shard {self.shard}: fenced by a newer writer of {self.transactional_id}; attempt "
                    f"{claim.attempt} is not written"
                ) from exc
            error = _kafka_error_of(exc)
            if error is not None and error.txn_requires_abort():
                with contextlib.suppress(KafkaException):
                    producer.abort_transaction(_ABORT_TIMEOUT_S)
            raise KafkaWriteError(
                f"shard {self.shard}: transaction of attempt {claim.attempt} failed ({exc}); "
                f"delivery errors: {self._errors[:3]}"
            ) from exc
        if self._errors:  # commit_transaction fails on delivery errors; this is a second line of defence
            raise KafkaWriteError(f"shard {self.shard}: delivery errors {self._errors[:3]}")
        self.stats.transactions += 1
        return [replace(d, error="MSG_SIZE_TOO_LARGE") for d in too_large]

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self._errors.append(str(err))

    def _settle(self, attempt: int, too_large: list[DeadLetter]) -> None:
        """Step 3 on its own (usually the next claim does it, ``_unsettled``): the attempt committed; clear its pending
        mark (only if it is still the shard's attempt), and forget the ids of records the producer refused (they went
        to dead letters, not Kafka)."""
        table = self.ledger.table
        with self.ledger.pool.connection() as conn, conn.pipeline(), conn.transaction():  # one round trip
            # Not waiting for the WAL to reach the disk is safe here: a settle lost in a server crash leaves the
            # attempt pending, and the next claim asks the Kafka marker, which says it committed.
            conn.execute("SET LOCAL synchronous_commit = off")
            conn.execute(
                f"UPDATE {table}_shards SET pending = false, committed = %s "
                "WHERE sink_group = %s AND shard = %s AND attempt = %s",
                (attempt, self.sink_group, self.shard, attempt),
            )
            if too_large:
                keys = [ledger_key(dict(d.attributes)["record_id"]) for d in too_large]
                conn.execute(
                    f"DELETE FROM {table} WHERE sink_group = %s AND record_key = ANY(%s::text[])",
                    (self.sink_group, text_array(keys)),
                )

    def close(self) -> None:
        if self._unsettled and self._last_attempt is not None:
            # Best effort: a mark left set only makes the next writer ask the Kafka marker, which says committed.
            with contextlib.suppress(Exception):
                self._settle(self._last_attempt, [])
            self._unsettled = False
        self._drop_producer()
        reader, self._marker_reader = self._marker_reader, None
        if reader is not None:
            reader.close()
