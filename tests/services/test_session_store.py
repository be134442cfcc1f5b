"""The sessions store on the real PostgreSQL: any run boundaries and crash reruns leave one run's sessions.

The property test plays the clicks job's bounded runs without Beam: a stream of events (users, event times out of
order, types, Kafka partitions and offsets) is read by consecutive runs, each from the group's committed offsets to
the end produced so far; a run's sessions are formed from its own events alone (as the job forms them) and written
through ``SessionStore`` in random batches (bundles). A run may crash after some or all of its batches landed and
before the commit: the next run reads again from the old offsets. The table must then equal one run over everything.
"""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from beamflow.aggregates import SessionClicks
from beamflow.postgres.sessions import Session, SessionStore

pytestmark = pytest.mark.services

GAP_MS = 600_000


@dataclass(frozen=True)
class Event:
    user: str
    time_ms: int
    kind: str
    partition: int
    offset: int


def sessions_of(events: Sequence[Event], gap_ms: int = GAP_MS) -> list[Session]:
    """What one run forms from ``events`` alone: per user, windows [t, t + gap) merged when they overlap."""
    by_user: dict[str, list[Event]] = {}
    for e in events:
        by_user.setdefault(e.user, []).append(e)
    out = []
    for user, mine in sorted(by_user.items()):
        mine.sort(key=lambda e: e.time_ms)
        group: list[Event] = []
        for e in [*mine, None]:
            if group and (e is None or e.time_ms >= group[-1].time_ms + gap_ms):
                value = SessionClicks()
                for g in group:
                    value = value.add(g.kind, g.time_ms * 1000, g.partition, g.offset)
                start = dt.datetime.fromtimestamp(group[0].time_ms / 1000, dt.UTC)
                end = dt.datetime.fromtimestamp((max(g.time_ms for g in group) + gap_ms) / 1000, dt.UTC)
                out.append(Session(user, start, end, value))
                group = []
            if e is not None:
                group.append(e)
    return out


@pytest.fixture
def table(postgres: object) -> Iterator[tuple[str, str]]:
    dsn = postgres.info["dsn"]  # type: ignore[attr-defined]
    name = f"sessions_{uuid.uuid4().hex[:8]}"
    yield dsn, name
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in (name, f"{name}_events"):
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))


def _fresh(dsn: str) -> SessionStore:
    store = SessionStore.connect(dsn, f"sessions_{uuid.uuid4().hex[:8]}")
    store.ensure_table()
    return store


def _drop(dsn: str, store: SessionStore) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for spec in (store.spec, store.ledger):
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(spec.qualified))


def _rows(store: SessionStore) -> list[dict[str, object]]:
    return [s.stored_row() for s in store.read()]


def _expected(events: Sequence[Event]) -> list[dict[str, object]]:
    return [s.stored_row() for s in sessions_of(events)]


def _ledger(dsn: str, store: SessionStore) -> set[tuple[int, int]]:
    with psycopg.connect(dsn) as conn:
        query = sql.SQL("SELECT kafka_partition, kafka_offset FROM {}").format(store.ledger.qualified)
        return {(int(p), int(o)) for p, o in conn.execute(query).fetchall()}


def _overlapping_pairs(store: SessionStore) -> int:
    sessions = store.read()
    return sum(1 for a, b in itertools.pairwise(sessions) if a.user_id == b.user_id and b.start < a.end)


# ---- the property --------------------------------------------------------------------------------------------------

users = st.sampled_from(["u0", "u1", "u2"])
raw_events = st.lists(
    st.tuples(users, st.integers(0, 90), st.sampled_from(["impression", "click"]), st.integers(0, 1)),
    min_size=1,
    max_size=40,
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Event], list[tuple[int, int, bool]]]:
    """Events (time in minutes, so sessions of a 10-minute gap both form and break) and runs: (produced up to, number
    of batches, whether the run crashed before its commit)."""
    raw = draw(raw_events)
    next_offset = [0, 0]
    events = []
    for user, minute, kind, partition in raw:
        events.append(Event(user, minute * 60_000 + len(events), kind, partition, next_offset[partition]))
        next_offset[partition] += 1
    cuts = sorted(draw(st.lists(st.integers(0, len(events)), max_size=5)))
    runs = [(cut, draw(st.integers(1, 3)), draw(st.booleans())) for cut in [*cuts, len(events)]]
    # The last run always finishes (commits): the stream is fully read in the end.
    runs.append((len(events), draw(st.integers(1, 3)), False))
    return events, runs


def _play(store: SessionStore, events: list[Event], runs: list[tuple[int, int, bool]]) -> None:
    committed = {0: 0, 1: 0}
    for produced, batches, crashes in runs:
        read = [e for e in events[:produced] if e.offset >= committed[e.partition]]
        rows = sessions_of(read)
        for i in range(batches):  # bundles: any split of the run's rows
            store.write(rows[i::batches])
        if not crashes:
            for e in read:
                committed[e.partition] = max(committed[e.partition], e.offset + 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios())
def test_any_runs_and_crash_reruns_give_one_runs_sessions(
    postgres: object, scenario: tuple[list[Event], list[tuple[int, int, bool]]]
) -> None:
    dsn = postgres.info["dsn"]  # type: ignore[attr-defined]
    events, runs = scenario
    runs_store, one_store = _fresh(dsn), _fresh(dsn)
    try:
        _play(runs_store, events, runs)
        one_store.write(sessions_of(events))
        assert _rows(runs_store) == _rows(one_store)
        assert sum(s.value.events for s in runs_store.read()) == len(events)
        assert _ledger(dsn, runs_store) == {(e.partition, e.offset) for e in events}
        assert _overlapping_pairs(runs_store) == 0
    finally:
        _drop(dsn, runs_store)
        _drop(dsn, one_store)


# ---- examples ------------------------------------------------------------------------------------------------------


def _ev(user: str, minute: float, offset: int, kind: str = "impression", partition: int = 0) -> Event:
    return Event(user, int(minute * 60_000), kind, partition, offset)


def test_a_late_event_bridging_two_stored_sessions_merges_all_three(table: tuple[str, str]) -> None:
    dsn, name = table
    store = SessionStore.connect(dsn, name)
    store.ensure_table()
    first = [_ev("u", 0, 0), _ev("u", 1, 1, "click"), _ev("u", 15, 2)]
    store.write(sessions_of(first))
    assert len(store.read()) == 2
    bridge = [_ev("u", 8, 3)]  # within 10 minutes of both
    stats = store.write(sessions_of(bridge))
    [merged] = store.read()
    assert (merged.value.impressions, merged.value.clicks, merged.value.events) == (3, 1, 4)
    assert stats.rows_deleted == 2 and stats.rows_inserted == 1
    assert _rows(store) == _expected(first + bridge)


def test_a_replayed_batch_changes_nothing_and_counts_nothing_twice(table: tuple[str, str]) -> None:
    dsn, name = table
    store = SessionStore.connect(dsn, name)
    store.ensure_table()
    events = [_ev("u", m, i, "click" if i % 3 == 0 else "impression", i % 2) for i, m in enumerate([0, 2, 4, 30, 31])]
    rows = sessions_of(events)
    store.write(rows + rows)  # one batch carrying every event twice counts each once
    before = _rows(store)
    assert before == _expected(events)
    stats = store.write(rows)
    assert _rows(store) == before
    assert stats.rows_inserted == stats.rows_deleted == 0 and stats.unchanged == 2
    assert stats.events_already_stored == 5
    # A rerun that reads the first events again plus new ones: the new ones only are added.
    more = [*events, _ev("u", 33, 5)]
    store.write(sessions_of(more))
    assert _rows(store) == _expected(more)


def test_rows_without_every_events_offsets_are_refused(table: tuple[str, str]) -> None:
    dsn, name = table
    store = SessionStore.connect(dsn, name)
    store.ensure_table()
    now = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    blind = Session("u", now, now + dt.timedelta(minutes=10), SessionClicks(impressions=2))
    with pytest.raises(ValueError, match="Kafka offsets"):
        store.write([blind])


def test_a_table_of_another_layout_is_refused(table: tuple[str, str]) -> None:
    dsn, name = table
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (user_id text, session_start timestamptz, PRIMARY KEY (user_id, session_start))"
            ).format(sql.Identifier(name))
        )
    with pytest.raises(RuntimeError, match="another layout"):
        SessionStore.connect(dsn, name).ensure_table()


def test_a_table_with_rows_but_no_ledger_is_refused_and_a_new_table_drops_a_stale_ledger(
    table: tuple[str, str],
) -> None:
    dsn, name = table
    store = SessionStore.connect(dsn, name)
    store.ensure_table()
    events = [_ev("u", 0, 0), _ev("u", 1, 1)]
    store.write(sessions_of(events))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(store.spec.qualified))
    # The ledger outlived its table: a new table must not inherit its claims (the events would never be counted).
    store.ensure_table()
    store.write(sessions_of(events))
    assert _rows(store) == _expected(events)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(store.ledger.qualified))
    with pytest.raises(RuntimeError, match="no events ledger"):
        store.ensure_table()


def test_concurrent_writers_of_one_user_are_serialised(table: tuple[str, str]) -> None:
    """Two transactions for a user with no stored row yet: the advisory lock keeps them from both inserting."""
    dsn, name = table
    SessionStore.connect(dsn, name).ensure_table()
    events = [_ev("u", m, i) for i, m in enumerate(range(0, 60, 5))]  # one session of 12 events
    errors: list[BaseException] = []

    def write(part: list[Event]) -> None:
        try:
            for e in part:
                SessionStore.connect(dsn, name).write(sessions_of([e]))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(events[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store = SessionStore.connect(dsn, name)
    assert _rows(store) == _expected(events)


def test_a_writer_merges_its_free_users_at_once_and_waits_only_for_a_locked_one(table: tuple[str, str]) -> None:
    """Another writer holds user "hot"'s lock: this write commits "cold" at once, without holding "cold"'s lock while
    it waits, and merges "hot" once the lock is released, each counted once."""
    from beamflow.postgres.sessions import _lock_key

    dsn, name = table
    store = SessionStore.connect(dsn, name)
    store.ensure_table()
    events = [_ev("hot", 0, 0), _ev("cold", 0, 1), _ev("hot", 1, 2, "click")]
    done = threading.Event()
    stats: list[object] = []
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(store.spec.display_name, "hot"),))
        writer = threading.Thread(target=lambda: (stats.append(store.write(sessions_of(events))), done.set()))
        writer.start()
        deadline = time.monotonic() + 30
        while not [s for s in SessionStore.connect(dsn, name).read() if s.user_id == "cold"]:
            assert time.monotonic() < deadline, "the free user was not merged while another writer held a lock"
            time.sleep(0.05)
        assert not done.is_set()  # "hot" waits for its lock
        with psycopg.connect(dsn, autocommit=True) as other:  # "cold"'s lock is not held while the write waits
            assert other.execute(
                "SELECT pg_try_advisory_lock(%s)", (_lock_key(store.spec.display_name, "cold"),)
            ).fetchone() == (True,)
        holder.rollback()  # releases "hot"
    writer.join(30)
    assert done.is_set()
    assert _rows(store) == _expected(events)
    assert stats[0].batches == 2  # type: ignore[attr-defined]
