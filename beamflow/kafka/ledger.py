"""The PostgreSQL ledger behind the exactly-once Kafka writer (``beamflow.kafka.exactly_once``): which record ids
each sink group has written, and each shard's attempt. No Beam."""

from __future__ import annotations

import hashlib

__all__ = ["ShardLedger", "ledger_key"]


class ShardLedger:
    """The PostgreSQL side of exactly-once: which record ids each sink group has written, and each shard's attempt.

    Tables ``<table>`` (sink_group, record_key) -> (shard, attempt), ``record_key`` the hex of a 16-byte digest of the
    record id (``ledger_key``: a short fixed-size key keeps the index small whatever ids look like; text, because
    psycopg adapts a text array several times faster than a bytea array); ``<table>_shards``
    (sink_group, shard) -> (topic, attempt, pending, committed); ``<table>_attempts`` (sink_group, shard, attempt) ->
    (written_at, aborted), one row per claimed attempt, so the big table needs no timestamp column.

    Every record written costs one row and one index entry (its primary key), nothing more: the claim is the sink's
    largest cost per record. So an aborted attempt's ids are not deleted (that needs an index by attempt, a second entry
    per id: about a quarter of the claim's time, measured); its ``_attempts`` row is marked ``aborted`` and a claim
    takes an id found under an aborted attempt as new. (Ledgers written by beamflow before this format had that index;
    ``create`` drops it. An older beamflow must not write a ledger this one has written: it would take the ids of an
    aborted attempt as written.)

    Ids older than ``retention_s`` are pruned: a record replayed after that long is written again, so keep it longer
    than the longest outage plus the job's replay window (the source's offset lag at a restore). Pruning scans the
    table (no index by age), so it runs only once some attempt is older than the retention plus a tenth of it: the
    table holds up to 1.1 retentions, and a writer looks at most every ``prune_every_s``.
    """

    def __init__(
        self,
        dsn: str,
        table: str,
        retention_s: float = 7 * 86400,
        prune_every_s: float = 600.0,
        connections: int = 2,
    ) -> None:
        from beamflow.postgres.table import validate_identifier
        from beamflow.postgres.writer import open_pool

        validate_identifier(table, "ledger table")
        validate_identifier(f"{table}_attempts", "ledger table (with its _attempts suffix)")
        if retention_s <= 0:
            raise ValueError("ledger retention must be positive: replays are recognised only while ids are kept")
        self.table = table
        self.retention_s = retention_s
        self.prune_every_s = prune_every_s
        self.pool = open_pool(dsn, max_size=connections)
        self._created = False

    def create(self) -> None:
        if self._created:
            return
        from beamflow.postgres.table import lock_creation

        with self.pool.connection() as conn, conn.transaction():
            lock_creation(conn, self.table)
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self.table} (sink_group text NOT NULL, record_key text NOT NULL, "
                "shard integer NOT NULL, attempt bigint NOT NULL, PRIMARY KEY (sink_group, record_key))"
            )
            # The earlier format's index by attempt: a second index entry per id, which claims no longer need.
            conn.execute(f"DROP INDEX IF EXISTS {self.table}_attempt")
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self.table}_attempts (sink_group text NOT NULL, shard integer NOT NULL, "
                "attempt bigint NOT NULL, written_at timestamptz NOT NULL DEFAULT now(), "
                "aborted boolean NOT NULL DEFAULT false, PRIMARY KEY (sink_group, shard, attempt))"
            )
            # Only when missing: ALTER TABLE locks the table exclusively even when it changes nothing, and each
            # worker process opens the ledger once.
            missing = conn.execute(
                "SELECT NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) "
                "AND attname = 'aborted' AND NOT attisdropped)",
                (f"{self.table}_attempts",),
            ).fetchone()
            if missing and missing[0]:
                conn.execute(f"ALTER TABLE {self.table}_attempts ADD COLUMN aborted boolean NOT NULL DEFAULT false")
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self.table}_shards (sink_group text NOT NULL, shard integer NOT NULL, "
                "topic text NOT NULL, attempt bigint NOT NULL, pending boolean NOT NULL, committed bigint NOT NULL, "
                "PRIMARY KEY (sink_group, shard))"
            )
        self._created = True

    def prune(self, sink_group: str) -> int:
        """Deletes the group's ids older than the retention once some are older than 1.1 retentions; returns how
        many. One pruner per group at a time (the others skip: concurrent deletes of the same rows could deadlock),
        never an id of a pending attempt."""
        with self.pool.connection() as conn, conn.transaction():
            got = conn.execute(
                "SELECT pg_try_advisory_xact_lock(hashtext(%s))", (f"beamflow-prune:{self.table}:{sink_group}",)
            ).fetchone()
            if not got or not got[0]:
                return 0
            # The delete below scans the whole table: only when there is enough to delete (class docstring).
            due = conn.execute(
                f"SELECT 1 FROM {self.table}_attempts WHERE sink_group = %s "
                "AND written_at < now() - make_interval(secs => %s) LIMIT 1",
                (sink_group, float(self.retention_s) * 1.1),
            ).fetchone()
            if due is None:
                return 0
            # A shard's attempts are numbered in time order (under its row lock), so "written before the cutoff" is
            # "attempt <= the newest attempt written before it", per shard.
            old = (
                f"SELECT shard, max(attempt) AS upto FROM {self.table}_attempts WHERE sink_group = %s "
                "AND written_at < now() - make_interval(secs => %s) GROUP BY shard"
            )
            cursor = conn.execute(
                f"DELETE FROM {self.table} AS r USING ({old}) AS o WHERE r.sink_group = %s AND r.shard = o.shard "
                f"AND r.attempt <= o.upto AND NOT EXISTS (SELECT 1 FROM {self.table}_shards s "
                "WHERE s.sink_group = r.sink_group AND s.shard = r.shard AND s.pending AND s.attempt = r.attempt)",
                (sink_group, float(self.retention_s), sink_group),
            )
            deleted = cursor.rowcount
            conn.execute(
                f"DELETE FROM {self.table}_attempts AS a WHERE a.sink_group = %s "
                "AND a.written_at < now() - make_interval(secs => %s) AND NOT EXISTS (SELECT 1 FROM "
                f"{self.table}_shards s WHERE s.sink_group = a.sink_group AND s.shard = a.shard AND s.pending "
                "AND s.attempt = a.attempt)",
                (sink_group, float(self.retention_s)),
            )
            return deleted

    def close(self) -> None:
        self.pool.close()


def ledger_key(identity: str) -> str:
    """The ledger's key of a record id: its 16-byte BLAKE2b digest in hex (collisions: about 2^-64 at 2^32 ids)."""
    return hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()
