"""The committer's known keys (beamflow/iceberg/known_keys.py) on a real pyiceberg table (SQLite catalog, local files).

Two committers of one table (two subtasks of a streaming job): each must see the other's keys, reading only the files
appended since it last looked, never scanning the table again; a snapshot that may remove rows, or an expired known
snapshot, sends it back to a scan. The first test is shown to fail when the committer does not follow the table.
"""

from __future__ import annotations

import datetime as dt
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from beamflow.config import ConfigError, load_job_config
from beamflow.iceberg.catalog import CatalogConfig, open_catalog
from beamflow.iceberg.committer import IcebergCommitter
from beamflow.iceberg.known_keys import KnownKeys, _contains, _encode, _merged
from beamflow.process_memory import glibc_heap_mb

pytestmark = pytest.mark.unit


def _rows(ids: range, day: int = 1) -> list[dict[str, Any]]:
    return [
        {
            "event_id": f"e{i}",
            "event_time": dt.datetime(2026, 1, day, 0, 0, i % 60, tzinfo=dt.UTC),
            "_kafka": {"topic": "t", "partition": i % 2, "offset": i},
        }
        for i in ids
    ]


def _committers(tmp_path: Path, n: int = 2) -> tuple[Any, list[IcebergCommitter]]:
    catalog = open_catalog(CatalogConfig.local(tmp_path))
    catalog.create_namespace("kk")
    return catalog, _committers_of(catalog, n)


def _committers_of(catalog: Any, n: int) -> list[IcebergCommitter]:
    return [
        IcebergCommitter(
            catalog,
            "kk.t",
            "kk-sink",
            key_column="event_id",
            key_time_column="event_time",
            partition_by=[("event_time", "day")],
        )
        for _ in range(n)
    ]


def _ids(catalog: Any) -> list[str]:
    return sorted(catalog.load_table("kk.t").scan().to_arrow()["event_id"].to_pylist())


class _Stale(KnownKeys):
    """The broken variant: never reads what other committers appended."""

    def _follow(self, table: Any, base: Any) -> None:
        self._snapshot_id = base.snapshot_id


def test_two_committers_see_each_others_keys_by_reading_only_the_new_files(tmp_path: Path) -> None:
    catalog, (a, b) = _committers(tmp_path)
    a.commit(_rows(range(0, 60)))
    # The first commit on a snapshot scans its range once: the whole minute of event time the later rows fall in.
    assert a.commit(_rows(range(60, 120))).rows_written == 60
    assert a.known_keys is not None and b.known_keys is not None
    assert a.known_keys.stats.scans == 1
    for start in range(120, 200, 10):
        assert b.commit(_rows(range(start, start + 10))).rows_written == 10
        # Replays of everything so far, through the committer that did not write the newest rows.
        replay = a.commit(_rows(range(0, start + 10)))
        assert (replay.rows_written, replay.rows_existing_key) == (0, start + 10)
    assert _ids(catalog) == sorted(f"e{i}" for i in range(200))
    assert a.known_keys.stats.scans == 1, "a commit after the first must not scan the table again"
    assert a.known_keys.stats.files_read == 8, "only b's eight appended files are read"
    assert a.known_keys.stats.resets == 0


def test_the_check_fails_when_the_committer_does_not_follow_the_table(tmp_path: Path) -> None:
    catalog, (a, b) = _committers(tmp_path)
    a.known_keys = _Stale("event_id", "event_time", a._scan_columns)
    a.commit(_rows(range(0, 60)))
    a.commit(_rows(range(60, 120)))  # covers the minute: no scan answers for the rows below
    b.commit(_rows(range(120, 130)))
    a.commit(_rows(range(120, 130)))  # b's rows again: a stale view appends them twice
    ids = _ids(catalog)
    assert len(ids) > len(set(ids)), "the broken variant must write duplicates, or the first test proves nothing"


def test_a_wider_time_range_scans_only_the_part_not_covered(tmp_path: Path) -> None:
    catalog, (a, b) = _committers(tmp_path)
    b.commit(_rows(range(0, 10), day=2))
    b.commit(_rows(range(10, 20), day=3))
    assert a.commit(_rows(range(0, 10), day=2)).rows_existing_key == 10
    assert a.commit(_rows(range(10, 20), day=3)).rows_existing_key == 10  # day 3 was not covered: one more scan
    assert a.commit(_rows(range(30, 40), day=2)).rows_written == 10  # covered: no scan
    assert a.known_keys is not None and a.known_keys.stats.scans == 2
    assert len(_ids(catalog)) == 30


def test_rows_removed_by_a_delete_are_accepted_again(tmp_path: Path) -> None:
    from pyiceberg.expressions import EqualTo

    catalog, (a,) = _committers(tmp_path, 1)
    a.commit(_rows(range(0, 10)))
    a.commit(_rows(range(10, 20)))
    catalog.load_table("kk.t").delete(EqualTo("event_id", "e3"))  # not an append: what a knows may be gone
    again = a.commit(_rows(range(0, 20)))
    assert (again.rows_written, again.rows_existing_key) == (1, 19)
    assert a.known_keys is not None and a.known_keys.stats.resets == 1
    assert _ids(catalog) == sorted(f"e{i}" for i in range(20))


def test_an_expired_known_snapshot_sends_the_committer_back_to_a_scan(tmp_path: Path) -> None:
    from beamflow.iceberg.maintenance import expire_snapshots

    catalog, (a, b) = _committers(tmp_path)
    a.commit(_rows(range(0, 10)))
    a.commit(_rows(range(10, 20)))
    for start in range(20, 50, 10):
        b.commit(_rows(range(start, start + 10)))
    expire_snapshots(lambda: catalog.load_table("kk.t"), keep_last=1)
    replay = a.commit(_rows(range(0, 50)))
    assert (replay.rows_written, replay.rows_existing_key) == (0, 50)
    assert a.known_keys is not None and a.known_keys.stats.resets == 1
    assert _ids(catalog) == sorted(f"e{i}" for i in range(50))


def _minute_rows(ids: range, minute: int) -> list[dict[str, Any]]:
    """Rows whose event times fall in one minute of 2026-01-01 (a stream's batch: its latest minute of events)."""
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(minutes=minute)
    return [
        {
            "event_id": f"e{i}",
            "event_time": start + dt.timedelta(seconds=i % 60),
            "_kafka": {"topic": "t", "partition": i % 2, "offset": i},
        }
        for i in ids
    ]


def test_a_stream_past_max_keys_drops_its_oldest_minutes_not_every_key(tmp_path: Path) -> None:
    """A stream holding more keys than ``max_keys`` (every committer follows every other's appends) must keep
    committing without a scan per commit: the bound drops the oldest minutes, not everything. Before the fix, past
    the bound every key was dropped and each commit scanned the batch's whole day again (here: a scan per commit)."""
    catalog, (a, b) = _committers(tmp_path)
    assert a.known_keys is not None and b.known_keys is not None
    a.known_keys.max_keys = b.known_keys.max_keys = 100
    a.commit(_minute_rows(range(0, 20), 0))  # the table's first snapshot: nothing to look up yet
    for minute in range(1, 40):  # 40 batches of 20 rows, a minute of event time each, alternating writers
        writer = a if minute % 2 else b
        assert writer.commit(_minute_rows(range(minute * 20, minute * 20 + 20), minute)).rows_written == 20
        assert len(writer.known_keys or []) <= 100 + 20, "the bound holds, up to the batch just added"
    # Each committer scanned its first batch's hour once; from then on it followed the other's files.
    assert (a.known_keys.stats.scans, b.known_keys.stats.scans) == (1, 1)
    assert a.known_keys.stats.resets == b.known_keys.stats.resets == 0
    assert a.known_keys.stats.evicted_buckets > 0
    # A replay of the newest minute is answered from memory; one of a dropped minute by a scan of just that minute.
    assert a.commit(_minute_rows(range(780, 800), 39)).rows_existing_key == 20
    assert a.known_keys.stats.scans == 1
    assert a.commit(_minute_rows(range(40, 60), 2)).rows_existing_key == 20
    assert a.known_keys.stats.scans == 2
    assert _ids(catalog) == sorted(f"e{i}" for i in range(800))


def test_a_date_time_column_is_covered_as_the_whole_table(tmp_path: Path) -> None:
    """Minutes need a time of day: with a date column the keys cover the whole table, still exactly."""
    catalog = open_catalog(CatalogConfig.local(tmp_path))
    catalog.create_namespace("kk")
    a, b = (IcebergCommitter(catalog, "kk.d", "kk-sink", key_column="event_id", key_time_column="day") for _ in "ab")

    def rows(ids: range) -> list[dict[str, Any]]:
        return [{"event_id": f"e{i}", "day": dt.date(2026, 1, 1 + i % 2)} for i in ids]

    a.commit(rows(range(0, 10)))
    assert a.commit(rows(range(10, 20))).rows_written == 10
    assert b.commit(rows(range(0, 30))).rows_written == 10  # b scans once, then writes only e20-e29
    assert (a.commit(rows(range(0, 30))).rows_existing_key, a.known_keys and a.known_keys.stats.scans) == (30, 1)
    ids = sorted(catalog.load_table("kk.d").scan().to_arrow()["event_id"].to_pylist())
    assert ids == sorted(f"e{i}" for i in range(30))


def test_a_scan_of_a_busy_hour_holds_no_more_than_the_bound(tmp_path: Path) -> None:
    """A committer starting on a table whose hour holds more keys than ``max_keys`` (a restart on a busy stream's
    backlog: at 1,500 events/s an hour is 5.4 million ids) must not hold what it scans whole: its scan covers the
    batch's minutes and then the newest others while the bound allows. Before, every key of the scanned hour was
    held until the batch was done (here 310 against a bound of 100)."""
    catalog, (a, b) = _committers(tmp_path)
    for minute in range(30):  # b writes 30 minutes of one hour, 10 keys a minute
        assert b.commit(_minute_rows(range(minute * 10, minute * 10 + 10), minute)).rows_written == 10
    assert a.known_keys is not None
    a.known_keys.max_keys = 100
    # a's first batch replays the hour's first minute: the hour is scanned, all 300 keys.
    assert a.commit(_minute_rows(range(0, 10), 0)).rows_existing_key == 10
    assert a.known_keys.stats.scans == 1
    assert a.known_keys.stats.peak_keys <= 100 + 10, "the bound holds through the scan, up to the batch's own keys"
    # Minutes the scan did not keep are not known to be empty: each is scanned alone when a batch needs it.
    assert a.commit(_minute_rows(range(290, 300), 29)).rows_existing_key == 10  # kept: the newest
    assert a.known_keys.stats.scans == 1
    assert a.commit(_minute_rows(range(50, 60), 5)).rows_existing_key == 10  # left out: one scan of minute 5
    assert a.known_keys.stats.scans == 2
    assert a.known_keys.stats.peak_keys <= 100 + 10
    # A committer whose first batch alone is over the bound still covers the hour's empty minutes (they cost
    # nothing): the stream's next minutes are answered without a scan each.
    (c,) = _committers_of(catalog, 1)
    assert c.known_keys is not None
    c.known_keys.max_keys = 5
    assert c.commit(_minute_rows(range(290, 300), 29)).rows_existing_key == 10
    for minute in (30, 31):
        assert c.commit(_minute_rows(range(minute * 10, minute * 10 + 10), minute)).rows_written == 10
    assert c.known_keys.stats.scans == 1
    assert _ids(catalog) == sorted(f"e{i}" for i in range(320))


def test_the_bound_is_a_job_setting(tmp_path: Path) -> None:
    conf = str(Path(__file__).resolve().parents[2] / "conf" / "clicks.yaml")
    shipped = load_job_config(conf).iceberg
    assert shipped is not None and shipped.known_keys_max == 1_000_000
    ice = load_job_config(conf, ["iceberg.known_keys_max=5"]).iceberg
    assert ice is not None and ice.known_keys_max == 5
    with pytest.raises(ConfigError, match=r"iceberg\.known_keys_max must be at least 1"):
        load_job_config(conf, ["iceberg.known_keys_max=0"])
    catalog = open_catalog(CatalogConfig.local(tmp_path))
    committer = IcebergCommitter(catalog, "kk.t", "kk-sink", key_column="event_id", known_keys_max=ice.known_keys_max)
    assert committer.known_keys is not None and committer.known_keys.max_keys == 5


def test_a_sparse_stream_does_not_pile_up_empty_minutes(tmp_path: Path) -> None:
    """Empty minutes stay covered (they cost no keys), but not for ever: past ``max_empty`` the least recently needed
    go, or a stream with quiet minutes would grow its coverage by every quiet minute it ever saw."""
    catalog, (a, b) = _committers(tmp_path)
    assert a.known_keys is not None and b.known_keys is not None
    a.known_keys.max_keys = b.known_keys.max_keys = 100
    a.known_keys.max_empty = b.known_keys.max_empty = 30
    for step, minute in enumerate(range(0, 240, 2)):  # four hours, every other minute quiet
        writer = a if step % 2 else b
        assert writer.commit(_minute_rows(range(step * 20, step * 20 + 20), minute)).rows_written == 20
        covered = writer.known_keys.covered_buckets if writer.known_keys else 0
        # 30 empty minutes and the minutes that hold keys (100 keys, 20 a minute, and the batch's own).
        assert covered <= 30 + 100 // 20 + 1, f"{covered} minutes covered"
    assert a.commit(_minute_rows(range(0, 20), 0)).rows_existing_key == 20  # a dropped minute: scanned, exact
    assert _ids(catalog) == sorted(f"e{i}" for i in range(120 * 20))


def test_late_events_do_not_send_every_batch_back_to_a_scan(tmp_path: Path) -> None:
    """A stream past ``max_keys`` whose every batch carries an event three hours late (as the traffic generator's
    too-late share does): the late hour is scanned once, and its minutes stay covered while late events keep coming.
    Before, the late minute (the oldest, with one key) was dropped first, and the late hour's empty minutes with it
    (older than what the bound dropped), so each batch scanned a minute three hours back: in a soak each such scan
    read every file of the last three hours (a file holding a late row spans them), and the workers' CPU a minute
    doubled in 52 minutes at a constant rate. Here that was a scan per batch."""
    catalog, (a, b) = _committers(tmp_path)
    assert a.known_keys is not None and b.known_keys is not None
    a.known_keys.max_keys = b.known_keys.max_keys = 100
    for minute in range(180, 240):  # an hour of minutes, alternating writers: 20 rows on time, 1 three hours late
        first = minute * 21
        late = _minute_rows(range(first + 20, first + 21), minute - 180)
        rows = _minute_rows(range(first, first + 20), minute) + late
        writer = a if minute % 2 else b
        assert writer.commit(rows).rows_written == 21
        assert len(writer.known_keys or []) <= 100 + 21, "the bound holds, up to the batch just added"
    # Each committer's first batch scanned its two hours (the batch's, the late rows'); nothing was scanned after.
    assert (a.known_keys.stats.scans, b.known_keys.stats.scans) == (2, 2)
    assert a.known_keys.stats.evicted_buckets > 0
    # Replays of both kinds are known: the newest minute from memory, a dropped one by a scan of just that minute.
    assert a.commit(_minute_rows(range(239 * 21, 239 * 21 + 20), 239)).rows_existing_key == 20
    assert a.commit(_minute_rows(range(180 * 21, 180 * 21 + 20), 180)).rows_existing_key == 20
    assert _ids(catalog) == sorted(f"e{i}" for i in range(180 * 21, 240 * 21))


# ---- the keys' arrays: exact whatever the key -----------------------------------------------------------------------

_TRICKY = ["", "a", "a\x00", "a\x00\x00", "a\x01", "ab", "b", "é", "\x00", "z" * 40, "e1", "e10", "e2"]


def _key_arrays() -> list[tuple[str, Any, Any]]:
    words = pa.array(_TRICKY * 2, pa.string())
    ints = [-(2**40), -1, 0, 1, 7, 2**40]
    wide = pa.large_string()
    return [
        ("string", pa.array(_TRICKY, pa.string()), pa.array([*_TRICKY[::2], "c", "a\x02"], pa.string())),
        ("large_string", pa.array(_TRICKY, wide), pa.array(["a", "a\x00\x00\x00", "ab"], wide)),
        ("binary", pa.array([k.encode() for k in _TRICKY], pa.binary()), pa.array([b"a\x00", b"\xff"], pa.binary())),
        ("dictionary", pa.array(_TRICKY, pa.string()).dictionary_encode(), pa.array(["a", "é", "x"], pa.string())),
        ("sliced and chunked", pa.chunked_array([words.slice(3, 9), words.slice(14, 5)]), words.slice(1, 12)),
        ("int64", pa.array(ints, pa.int64()), pa.array([-1, 2, 2**40, 2**41], pa.int64())),
        ("int32 against int64", pa.array([1, 5, -3], pa.int32()), pa.array([5, 6, -3], pa.int64())),
        ("date", pa.array([dt.date(2026, 1, d) for d in (1, 2)]), pa.array([dt.date(2026, 1, d) for d in (2, 3)])),
    ]


@pytest.mark.parametrize("name, held, asked", _key_arrays(), ids=[case[0] for case in _key_arrays()])
def test_a_key_is_known_exactly_whatever_its_type_and_length(name: str, held: Any, asked: Any) -> None:
    """A bucket's keys live in one sorted fixed-width numpy array (no Python object per key). Looking a key up must
    answer what a Python set of the keys answers: keys that differ only by trailing NULs, by length, or by being a
    prefix of another are different keys; a bucket that grows by wider keys keeps its narrower ones whole."""
    expected = set(held.to_pylist())
    answers = [k in expected for k in asked.to_pylist()]
    assert _contains(_merged(None, _encode(held)), _encode(asked)).tolist() == answers
    # Grown in two steps, the short keys first: the bucket is widened, not the new keys cut to its width.
    values = sorted(expected, key=lambda k: len(str(k)))
    half = len(values) // 2
    first, second = pa.array(values[:half], held.type), pa.array(values[half:], held.type)
    grown = _merged(_merged(None, _encode(first)), _encode(second))
    assert len(grown) == len(expected)
    assert _contains(grown, _encode(asked)).tolist() == answers


def test_the_exactness_check_fails_for_plain_byte_strings_and_for_a_bucket_not_widened() -> None:
    """The check above is shown to fail for what the arrays would be without their care: numpy's plain byte strings
    (``a`` and ``a\\x00`` one key) and an insertion at the bucket's width (a longer key cut to a known prefix)."""
    plain = np.array([k.encode() for k in ["a", "b"]])  # dtype S1
    assert _contains(plain, np.array([b"a\x00"])).tolist() == [True], "plain byte strings confuse a and a\\x00"
    assert _contains(_merged(None, _encode(pa.array(["a", "b"]))), _encode(pa.array(["a\x00"]))).tolist() == [False]

    held = _encode(pa.array(["ab"]))
    longer = _encode(pa.array(["abcd"]))
    cut = np.insert(held, np.searchsorted(held, longer), longer)  # np.insert casts to the bucket's width
    assert cut.tolist() == [b"ab\x01", b"abc"], "a bucket not widened cuts the new key"
    assert _merged(held, longer).tolist() == [b"ab\x01", b"abcd\x01"]


def test_a_million_ids_are_held_in_a_third_of_what_a_set_took() -> None:
    """The memory claim of the module's docstring, measured: a million 32-character ids held as one minute's array
    take about 33 bytes each (tracemalloc counts numpy's buffers), against about 120 for a Python set of strs."""
    ids = pa.array([f"{i:032x}" for i in range(1_000_000)], pa.string())
    known = KnownKeys("event_id", "event_time", scan=lambda *_: pa.table({}))
    tracemalloc.start()
    try:
        known._hold(0, _encode(ids))
        held_bytes, _ = tracemalloc.get_traced_memory()
        as_set = {f"{i:032x}" for i in range(100_000)}
        set_bytes = tracemalloc.get_traced_memory()[0] - held_bytes
    finally:
        tracemalloc.stop()
    assert len(known) == 1_000_000 and len(as_set) == 100_000
    assert held_bytes < 40 * 1_000_000, f"{held_bytes / 1e6:.1f} bytes a key"
    assert set_bytes > 90 * 100_000, f"a set took {set_bytes / 1e5:.1f} bytes a key"  # what the arrays replace


def _heap_growth_over_a_stream(merge: str) -> float:
    """glibc's heap (MB) grown from minute 4 to minute 20 of a stream whose current minute's array grows by 1,500
    keys a commit, 60 commits a minute, the newest 11 minutes kept (a worker at the default bound and 1,500 events/s),
    with other allocations between; run in a fresh process, a heap of its own. ``merge``: ``held`` (``_merged``) or
    ``insert`` (``np.insert``, what the arrays first did)."""

    def by_insert(held: Any, keys: Any) -> Any:
        keys = np.unique(keys)
        if held is None:
            return keys
        keys = keys[~_contains(held, keys)]
        return np.insert(held, np.searchsorted(held, keys), keys)

    merged = _merged if merge == "held" else by_insert
    buckets: dict[int, Any] = {}
    others: list[bytearray] = []
    heap: list[float] = []
    for minute in range(20):
        for commit in range(60):
            first = (minute * 60 + commit) * 1500
            ids = pa.array([f"{i:032x}" for i in range(first, first + 1500)])
            buckets[minute] = merged(buckets.get(minute), _encode(ids))
            others = [*others[-50:], bytearray(2000 * (commit % 7 + 1))]
        if len(buckets) > 11:
            del buckets[min(buckets)]
        heap.append(glibc_heap_mb()["arena"])
    return heap[-1] - heap[3]


def test_a_growing_minute_leaves_no_holes_in_the_heap() -> None:
    """The current minute's array is replaced by one a commit larger at every commit. From glibc's heap, each old
    array left a hole too small for the next one, held as free memory: +2.2 MB a minute per worker in a soak. Held
    arrays get mappings of their own (``_held_array``): the heap stays flat, where ``np.insert``'s grows."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]

    def growth(merge: str) -> float:
        code = f"from tests.unit.test_iceberg_known_keys import _heap_growth_over_a_stream as g; print(g({merge!r}))"
        return float(
            subprocess.run([sys.executable, "-c", code], cwd=root, check=True, capture_output=True, text=True).stdout
        )

    held, inserted = growth("held"), growth("insert")
    assert held < 1.0, f"the heap grew {held:.1f} MB over 16 minutes with mapped arrays"
    assert inserted > 5.0, f"np.insert's heap grew {inserted:.1f} MB: the check would not see holes"


def test_a_row_without_a_key_is_refused_not_matched() -> None:
    """Keys are encoded without their nulls; a null key would shift every answer after it, so it is refused."""
    known = KnownKeys("event_id", "event_time", scan=lambda *_: pa.table({}))
    batch = pa.table({"event_id": pa.array(["a", None]), "event_time": pa.array([None, None], pa.timestamp("us"))})
    with pytest.raises(ValueError, match="key column 'event_id'"):
        known.new_rows(None, None, batch)  # type: ignore[arg-type]
