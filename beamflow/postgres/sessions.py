"""The sessions store: new (partial) sessions merged with the stored ones they touch, atomically per user. No Beam.

Why: a bounded run sees only the events of its own offset ranges, so a session that spans two runs arrives as two
partial sessions, and a rerun after a crash between the sinks and the offset commit (or a restored streaming job)
delivers events a stored session already counts. Upserting rows by (user, start) leaves both kinds of run boundary
visible: overlapping rows for one user, and events counted twice. ``SessionStore.write`` instead, per batch and in
ONE transaction per user (a batch is one transaction, or two when another writer holds some of its users' locks):

1. takes a transaction-scoped advisory lock per user (sorted, so concurrent writers cannot deadlock; two writers of
   one user are serialised even when that user has no stored row yet to lock). The first transaction only tries the
   locks and leaves out the users another writer holds; the second, after the first committed, waits for those;
2. claims the new sessions' events by Kafka coordinates in the table's events ledger (``<table>_events``, primary
   key partition and offset; ``INSERT ... ON CONFLICT DO NOTHING RETURNING``): only the events claimed now are
   counted, so an event that any stored session already counts is counted once, whatever run delivered it again;
3. reads the user's stored sessions whose window overlaps a new one (``start < new end AND end > new start``: the
   windows already carry the gap, ``[first event, last event + gap)``, so this is the ``Sessions`` merge rule) with
   ``SELECT ... FOR UPDATE``, again for the widened extents until nothing new turns up (transitive merges: a late
   event can bridge two stored sessions);
4. deletes the stored rows a merged row replaces and inserts the merged rows, whose counts are the stored counts
   plus the newly claimed events (a new session whose events are all claimed already, e.g. a pure replay, changes
   nothing).

Why a ledger and not the offsets in each row (the first layout): a never-ending session of a hot user collects
offsets scattered among other users' records, so its offset list grows with the session and was decoded, merged,
encoded and rewritten by every bundle that touched it, a cost quadratic in the session's length on a long stream.
The ledger costs one narrow index entry per event, written once.

Guarantee: after any sequence of batches (runs cut anywhere, batches repeated after crashes, in any order), the
table holds for each user exactly the sessions one pass over the union of all delivered events would form (windows
``[first, last + gap)`` merged when they overlap, each event counted once), provided every event was delivered
with its Kafka coordinates (one topic per table: the coordinates are partition and offset). A batch commits
entirely or not at all. A table from the first layout (offsets in the rows), or a sessions table with rows but no
ledger, is refused with a clear error.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from beamflow.aggregates import SessionClicks
from beamflow.kafka.offset_ranges import OffsetRanges
from beamflow.postgres.arrays import array_literal, int_array, text_array, timestamptz_array
from beamflow.postgres.retry import RetryPolicy
from beamflow.postgres.table import TableSpec, create_table, existing_columns

__all__ = [
    "LEDGER_COLUMNS",
    "OFFSET_COLUMNS",
    "SESSION_COLUMNS",
    "Session",
    "SessionStore",
    "SessionWriteStats",
    "ledger_spec",
    "sessions_spec",
]

SESSION_COLUMNS: dict[str, str] = {
    "user_id": "text NOT NULL",
    "session_start": "timestamptz NOT NULL",
    "session_end": "timestamptz NOT NULL",
    "impressions": "bigint NOT NULL",
    "clicks": "bigint NOT NULL",
    "first_event": "timestamptz",
    "last_event": "timestamptz",
    "events": "bigint NOT NULL",
    "pane_index": "bigint NOT NULL",
    "is_final": "boolean NOT NULL",
}
# A new session row (``SessionStore.write``'s input) also carries the Kafka coordinates of the events it counts, per
# type (OffsetRanges text: "0:100-180,190;2:5-9"); the store claims them in its ledger and keeps only the counts.
OFFSET_COLUMNS = ("impression_offsets", "click_offsets")
LEDGER_COLUMNS: dict[str, str] = {
    "kafka_partition": "integer NOT NULL",
    "kafka_offset": "bigint NOT NULL",
    "user_id": "text NOT NULL",
}
_NAMES = list(SESSION_COLUMNS)
_TYPES = {
    "text NOT NULL": "text",
    "timestamptz NOT NULL": "timestamptz",
    "timestamptz": "timestamptz",
    "bigint NOT NULL": "bigint",
    "integer NOT NULL": "integer",
    "boolean NOT NULL": "boolean",
}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MICRO = dt.timedelta(microseconds=1)


def sessions_spec(table: str) -> TableSpec:
    """The sessions table: one row per (user, session start); ``SessionStore`` keeps the rows of a user disjoint."""
    return TableSpec(table, key=("user_id", "session_start"), version=("events", "pane_index"), columns=SESSION_COLUMNS)


def ledger_spec(table: str) -> TableSpec:
    """The sessions table's events ledger, ``<table>_events``: the Kafka coordinates of every event counted."""
    sessions = sessions_spec(table)
    return TableSpec(
        f"{sessions.table}_events",
        key=("kafka_partition", "kafka_offset"),
        columns=LEDGER_COLUMNS,
        schema=sessions.schema,
    )


def _micros(when: dt.datetime | None) -> int | None:
    return None if when is None else (when - _EPOCH) // _MICRO


def _datetime(micros: int | float | None) -> dt.datetime | None:
    return None if micros is None else _EPOCH + dt.timedelta(microseconds=int(micros))


@dataclass(frozen=True)
class Session:
    """One user's session: window ``[start, end)`` (datetimes), its aggregate (event times as epoch micros)."""

    user_id: str
    start: dt.datetime
    end: dt.datetime
    value: SessionClicks
    pane_index: int = 0
    is_final: bool = False

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Session:
        """From a row with ``SESSION_COLUMNS`` and, for a new session, ``OFFSET_COLUMNS`` (a stored row has none)."""
        value = SessionClicks(
            int(row["impressions"]),
            int(row["clicks"]),
            _micros(row["first_event"]),
            _micros(row["last_event"]),
            OffsetRanges.decode(row.get("impression_offsets")),
            OffsetRanges.decode(row.get("click_offsets")),
        )
        return cls(
            row["user_id"],
            row["session_start"],
            row["session_end"],
            value,
            int(row["pane_index"]),
            bool(row["is_final"]),
        )

    def to_row(self) -> dict[str, Any]:
        """A new-session row: ``SESSION_COLUMNS`` and ``OFFSET_COLUMNS``."""
        return {
            **self.stored_row(),
            "impression_offsets": self.value.impression_offsets.encode(),
            "click_offsets": self.value.click_offsets.encode(),
        }

    def stored_row(self) -> dict[str, Any]:
        """The row as the table stores it: ``SESSION_COLUMNS`` (counts, no offsets)."""
        v = self.value
        return {
            "user_id": self.user_id,
            "session_start": self.start,
            "session_end": self.end,
            "impressions": v.impressions,
            "clicks": v.clicks,
            "first_event": _datetime(v.first_event_time),
            "last_event": _datetime(v.last_event_time),
            "events": v.events,
            "pane_index": self.pane_index,
            "is_final": self.is_final,
        }

    def coordinates(self) -> Iterator[tuple[int, int]]:
        """The (partition, offset) of every event it carries offsets for, impressions then clicks."""
        yield from _expand(self.value.impression_offsets)
        yield from _expand(self.value.click_offsets)


@dataclass
class SessionWriteStats:
    batches: int = 0
    rows_in: int = 0
    rows_inserted: int = 0
    rows_deleted: int = 0
    unchanged: int = 0
    # Events a new row carried that the stored rows already counted (replays recognised by their offsets).
    events_already_stored: int = 0
    retries: int = 0


@dataclass
class _Group:
    start: dt.datetime
    end: dt.datetime
    stored: list[Session] = field(default_factory=list)
    new: list[Session] = field(default_factory=list)


def _groups(stored: Iterable[Session], new: Iterable[Session]) -> list[_Group]:
    """Connected groups of one user's sessions by window overlap (``end > next start``, as ``Sessions`` merges)."""
    tagged = sorted([(s.start, 0, s) for s in stored] + [(s.start, 1, s) for s in new], key=lambda t: (t[0], t[1]))
    groups: list[_Group] = []
    for start, is_new, session in tagged:
        if not groups or groups[-1].end <= start:
            groups.append(_Group(start, session.end))
        group = groups[-1]
        group.end = max(group.end, session.end)
        (group.new if is_new else group.stored).append(session)
    return groups


def _expand(ranges: OffsetRanges) -> Iterator[tuple[int, int]]:
    for partition, first, last in ranges.ranges:
        for offset in range(first, last + 1):
            yield partition, offset


def _lock_key(table: str, user_id: str) -> int:
    digest = hashlib.blake2b(f"{table}\x00{user_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class SessionStore:
    """Merges new session rows into a sessions table (see the module docstring for the guarantee).

    ::

        store = SessionStore(conn_factory, "click_sessions")   # or SessionStore.connect(dsn, table)
        store.ensure_table()
        store.write(rows)                                       # dicts with SESSION_COLUMNS; each user atomically

    ``connection`` is a callable giving a context manager that yields a psycopg connection (a pool's
    ``pool.connection`` or ``lambda: psycopg.connect(dsn)``). Transient failures retry the whole transaction.
    """

    def __init__(self, connection: Any, table: str, retry: RetryPolicy | None = None) -> None:
        self.spec = sessions_spec(table)
        self.ledger = ledger_spec(table)
        self._connection = connection
        self._retry = retry or RetryPolicy()
        self.stats = SessionWriteStats()

    @classmethod
    def connect(cls, dsn: str, table: str, retry: RetryPolicy | None = None) -> SessionStore:
        from beamflow.secrets import postgres_conninfo

        # The password reference (env:/file:) is resolved at each connect, never stored in the store's state.
        return cls(lambda: psycopg.connect(postgres_conninfo(dsn)), table, retry)

    def ensure_table(self) -> None:
        """Creates the table and its events ledger if missing. A new sessions table starts with an empty ledger (one
        left by a dropped table counted events no row holds any more). Refuses a table whose counts cannot be merged
        exactly: one from the first layout (offsets in each row), or one with rows but no ledger."""

        def ensure() -> None:
            with self._connection() as conn, conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(self.spec.display_name, ""),))
                columns = {c.name for c in existing_columns(conn, self.spec) or []}
                ledger = existing_columns(conn, self.ledger) is not None
                if not columns:
                    if ledger:
                        conn.execute(sql.SQL("DROP TABLE {}").format(self.ledger.qualified))
                    create_table(conn, self.spec)
                    create_table(conn, self.ledger)
                    return
                name = self.spec.display_name
                missing = [c for c in _NAMES if c not in columns]
                if missing or columns & set(OFFSET_COLUMNS):
                    raise RuntimeError(
                        f"sessions table {name} has the columns of another layout (missing {missing}, offsets in "
                        f"each row: {sorted(columns & set(OFFSET_COLUMNS))}): its sessions cannot be merged exactly "
                        "with new ones; drop it (or write to a new table) and rebuild it from Kafka"
                    )
                if not ledger:
                    if conn.execute(sql.SQL("SELECT 1 FROM {} LIMIT 1").format(self.spec.qualified)).fetchone():
                        raise RuntimeError(
                            f"sessions table {name} has rows but no events ledger {self.ledger.display_name}: which "
                            "events its counts hold is unknown, so new sessions cannot be merged exactly; drop it (or "
                            "write to a new table) and rebuild it from Kafka"
                        )
                    create_table(conn, self.ledger)

        self._retry.call(ensure, on_retry=self._count_retry)

    def write(self, rows: Iterable[Session | Mapping[str, Any]]) -> SessionWriteStats:
        """Merges ``rows`` (new, possibly partial or repeated sessions) into the table; returns this call's counts.

        Each user's rows are merged in one transaction, under that user's lock. The first transaction takes the locks
        that are free and leaves out the users whose lock another writer holds (at parallelism 2 the other subtask
        writes the same hot users in nearly every batch); a second one, after the first committed, waits for those.
        So a writer never waits for a lock while holding its other users' locks, and two writers mostly proceed side
        by side instead of one after the other (measured: 2.4-2.7 s of 35 s per worker waiting, before).
        """
        sessions = [s if isinstance(s, Session) else Session.from_row(s) for s in rows]
        if not sessions:
            return SessionWriteStats()
        for s in sessions:
            if not s.value.exact:
                raise ValueError(
                    f"session of {s.user_id!r} at {s.start.isoformat()} carries {s.value.events} events but only "
                    f"{len(s.value.impression_offsets) + len(s.value.click_offsets)} Kafka offsets: the sessions "
                    "store needs every event's partition and offset to count each once"
                )
        by_user: dict[str, list[Session]] = defaultdict(list)
        for s in sessions:
            by_user[s.user_id].append(s)
        outcome = SessionWriteStats(rows_in=len(sessions))
        pending: Mapping[str, list[Session]] = by_user
        wait = False
        while pending:
            attempt = functools.partial(self._transaction, pending, wait)
            done, pending = self._retry.call(attempt, on_retry=self._count_retry)
            outcome.batches += 1
            for name in ("rows_inserted", "rows_deleted", "unchanged", "events_already_stored"):
                setattr(outcome, name, getattr(outcome, name) + getattr(done, name))
            wait = True  # the users left out: few, and their other writer has likely committed meanwhile
        for name in ("batches", "rows_in", "rows_inserted", "rows_deleted", "unchanged", "events_already_stored"):
            setattr(self.stats, name, getattr(self.stats, name) + getattr(outcome, name))
        return outcome

    def read(self, user_ids: Sequence[str] | None = None) -> list[Session]:
        """Stored sessions (of ``user_ids``, or all), ordered by user and start."""
        where = sql.SQL(" WHERE user_id = ANY(%s)") if user_ids is not None else sql.SQL("")
        query = sql.SQL("SELECT {cols} FROM {t}{where} ORDER BY user_id, session_start").format(
            cols=sql.SQL(", ").join(map(sql.Identifier, _NAMES)), t=self.spec.qualified, where=where
        )
        with self._connection() as conn:
            cur = conn.execute(query, (list(user_ids),) if user_ids is not None else ())
            return [Session.from_row(dict(zip(_NAMES, r, strict=True))) for r in cur.fetchall()]

    # ---- the transaction ----------------------------------------------------------------------------------------

    def _transaction(
        self, by_user: Mapping[str, list[Session]], wait: bool = True
    ) -> tuple[SessionWriteStats, dict[str, list[Session]]]:
        """Merges ``by_user`` in one transaction; returns its counts and the users left out (only when not ``wait``:
        those whose lock another writer held)."""
        out = SessionWriteStats()
        # Locks taken in one order by every writer (no deadlock between two merging overlapping users).
        keyed = sorted((_lock_key(self.spec.display_name, u), u) for u in by_user)
        left_out: dict[str, list[Session]] = {}
        with self._connection() as conn, conn.transaction():
            keys = int_array([k for k, _ in keyed])
            if wait:
                conn.execute("SELECT pg_advisory_xact_lock(k) FROM unnest(%s::bigint[]) AS u(k)", (keys,))
            else:
                # Try-locks never wait, so their order does not matter; the ones taken are held to the commit.
                held = conn.execute(
                    "SELECT k, pg_try_advisory_xact_lock(k) FROM unnest(%s::bigint[]) AS u(k)", (keys,)
                ).fetchall()
                busy = {k for k, taken in held if not taken}
                if busy:
                    left_out = {u: list(by_user[u]) for k, u in keyed if k in busy}
                    keyed = [(k, u) for k, u in keyed if k not in busy]
                    by_user = {u: by_user[u] for _, u in keyed}
            users = [u for _, u in keyed]
            by_user = self._claim(conn, by_user, out)
            users = [u for u in users if u in by_user]
            stored: dict[str, dict[dt.datetime, Session]] = defaultdict(dict)
            # Extents to look up: the new windows first, then whatever the merged groups grew to.
            probes = [(u, s.start, s.end) for u in users for s in by_user[u]]
            while probes:
                found = self._lock_overlapping(conn, probes)
                fresh = [s for s in found if s.start not in stored[s.user_id]]
                for s in fresh:
                    stored[s.user_id][s.start] = s
                if not fresh:
                    break
                grown = {s.user_id for s in fresh}
                probes = [(u, g.start, g.end) for u in sorted(grown) for g in _groups(stored[u].values(), by_user[u])]
            deletes: list[tuple[str, dt.datetime]] = []
            inserts: list[dict[str, Any]] = []
            for user in users:
                for group in _groups(stored[user].values(), by_user[user]):
                    merged = self._merge(group)
                    deletes.extend((s.user_id, s.start) for s in group.stored)
                    inserts.append(merged.stored_row())
            if deletes:
                cur = conn.execute(
                    sql.SQL(
                        "DELETE FROM {t} USING unnest(%s::text[], %s::timestamptz[]) AS d(user_id, session_start) "
                        "WHERE {t}.user_id = d.user_id AND {t}.session_start = d.session_start"
                    ).format(t=self.spec.qualified),
                    (text_array(u for u, _ in deletes), timestamptz_array(s for _, s in deletes)),
                )
                out.rows_deleted += max(cur.rowcount, 0)
            if inserts:
                cur = conn.execute(
                    sql.SQL("INSERT INTO {t} ({cols}) SELECT * FROM unnest({arrays})").format(
                        t=self.spec.qualified,
                        cols=sql.SQL(", ").join(map(sql.Identifier, _NAMES)),
                        arrays=sql.SQL(", ").join(
                            sql.SQL("%s::{}[]").format(sql.SQL(_TYPES[SESSION_COLUMNS[n]])) for n in _NAMES
                        ),
                    ),
                    [array_literal([row[n] for row in inserts], _TYPES[SESSION_COLUMNS[n]]) for n in _NAMES],
                )
                out.rows_inserted += max(cur.rowcount, 0)
        return out, left_out

    def _lock_overlapping(
        self, conn: psycopg.Connection[Any], probes: Sequence[tuple[str, dt.datetime, dt.datetime]]
    ) -> list[Session]:
        query = sql.SQL(
            "SELECT {cols} FROM {t} s "
            "JOIN unnest(%s::text[], %s::timestamptz[], %s::timestamptz[]) AS n(user_id, s_start, s_end) "
            "ON s.user_id = n.user_id AND s.session_start < n.s_end AND s.session_end > n.s_start "
            "ORDER BY s.user_id, s.session_start FOR UPDATE OF s"
        ).format(
            cols=sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(n)) for n in _NAMES), t=self.spec.qualified
        )
        cur = conn.execute(
            query,
            (
                text_array(p[0] for p in probes),
                timestamptz_array(p[1] for p in probes),
                timestamptz_array(p[2] for p in probes),
            ),
        )
        unique = {(r[0], r[1]): r for r in cur.fetchall()}  # a stored row may overlap several probes
        return [Session.from_row(dict(zip(_NAMES, r, strict=True))) for r in unique.values()]

    def _claim(
        self, conn: psycopg.Connection[Any], by_user: Mapping[str, list[Session]], out: SessionWriteStats
    ) -> dict[str, list[Session]]:
        """Claims the new sessions' events in the ledger; returns the sessions counting only the events claimed now
        (and none that claimed nothing). Each event is claimed by one session, even if two new ones carry it."""
        sessions = [s for u in sorted(by_user) for s in by_user[u]]
        users: list[str] = []
        partitions: list[int] = []
        offsets: list[int] = []
        for s in sessions:
            for partition, offset in s.coordinates():
                users.append(s.user_id)
                partitions.append(partition)
                offsets.append(offset)
        cur = conn.execute(
            sql.SQL(
                "INSERT INTO {t} (kafka_partition, kafka_offset, user_id) "
                "SELECT * FROM unnest(%s::integer[], %s::bigint[], %s::text[]) ON CONFLICT DO NOTHING "
                "RETURNING kafka_partition, kafka_offset"
            ).format(t=self.ledger.qualified),
            (int_array(partitions), int_array(offsets), text_array(users)),
        )
        unclaimed = set(cur.fetchall())

        def take(ranges: OffsetRanges) -> int:
            mine = [c for c in _expand(ranges) if c in unclaimed]
            unclaimed.difference_update(mine)
            return len(mine)

        fresh: dict[str, list[Session]] = defaultdict(list)
        for s in sessions:
            impressions, clicks = take(s.value.impression_offsets), take(s.value.click_offsets)
            out.events_already_stored += s.value.events - impressions - clicks
            if impressions + clicks == 0:
                out.unchanged += 1
                continue
            # The extent stays the whole session's: an event claimed before lies inside the stored session that
            # counts it (``[first, last + gap)``), so the merge below covers it either way.
            v = s.value
            value = SessionClicks(impressions, clicks, v.first_event_time, v.last_event_time)
            fresh[s.user_id].append(Session(s.user_id, s.start, s.end, value, s.pane_index, s.is_final))
        return fresh

    @staticmethod
    def _merge(group: _Group) -> Session:
        """Stored and newly counted sessions hold disjoint events (the ledger saw to it): their counts add up."""
        members = [*group.stored, *group.new]
        value = members[0].value
        for s in members[1:]:
            value = value.merge(s.value)
        newest = max(group.new, key=lambda s: s.pane_index) if group.new else members[0]
        return Session(
            members[0].user_id,
            min(s.start for s in members),
            max(s.end for s in members),
            value,
            newest.pane_index,
            any(s.is_final for s in group.new),
        )

    def _count_retry(self, _exc: BaseException) -> None:
        self.stats.retries += 1
