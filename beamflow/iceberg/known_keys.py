"""The keys already in an Iceberg table, kept up to date by reading only the data files added since (no Beam).

Why: a committer that deduplicates by a key column (``IcebergCommitter(key_column=...)``, the clicks job's event id)
must know which keys the table holds before each commit. Scanning the key column of every file in the batch's time
range on each commit costs what the table holds: a streaming job commits once per bundle, so on a 200,000-event
backlog the scans grew with every commit until a bundle outlasted the checkpoint timeout (checkpoints 7 s -> 29 s ->
expired, measured at parallelism 2 by ``benchmarks.flink_streaming``). ``KnownKeys`` scans a time range once, then
follows the table: on the next commit it reads the key column of the files that snapshots appended since the
snapshot it knows, and adds the keys a commit of its own wrote without reading them back.

Exactness: the answer for a key in a covered range is the table's content at the base snapshot, the same as a scan:

- only ``append`` snapshots add rows; a ``replace`` (compaction) rewrites rows it does not change, so its files are
  skipped; any other operation (``overwrite``, ``delete``: rows may be gone) or a base that does not descend from the
  known snapshot (expiry took it, or the history was rolled back) drops everything and starts over with a scan;
- coverage is kept per minute of ``time_column`` (``bucket_s``): a batch's minutes not covered yet are scanned, a
  whole hour at a time when none of that hour is covered (a backlog's batches all fall in about the same hours, and
  a scan of a sliver costs nearly what its hour costs to plan), else just the missing minutes;
- each minute's keys are one sorted numpy array of fixed width (``_encode``: exact, no hashing), and a row's key is
  looked up in its own minute (a key has one time: the committer's contract for ``key_time_column``). A million
  32-character ids are 33 MB so, where a Python set of them was about 120 MB of small objects: each streaming worker
  is about 90 MB smaller in a soak (``docs/streaming.md``, "The known keys as arrays");
- ``max_keys`` bounds the memory (the job setting ``iceberg.known_keys_max``): past it the minutes the batches needed
  least recently are dropped (the oldest first among those needed as long ago), and a later batch that needs one of
  them scans just that minute again. Before, past it every key was dropped and the next batch scanned its whole days
  again: once a day held more than ``max_keys`` rows (about an hour at 300 events/s, since every committer follows
  every other's appends), a stream went back to a scan of the day's key column per commit, the stall this module
  exists to prevent. Least recently needed, not oldest: a stream's late events fall in old minutes that hold a few
  keys each; dropped first as the oldest, each was scanned again by the next batch with a late event in it. In a
  soak with 0.2% of events three hours late that was a scan per minute per worker, each reading every file of the
  last three hours (a file holding a late row spans the three hours, so no file statistic prunes it): the workers'
  CPU a minute grew from 9 to 17.5 seconds in 52 minutes at a constant 1,500 events/s.
- empty minutes cost no keys and stay covered, up to ``max_empty`` of them (the least recently needed go first): a
  quiet stretch must not grow the coverage for ever, and a late hour's empty minutes, dropped while its late events
  still arrive, were each scanned again alone.
- a scan keeps the batch's minutes and then the newest others while the bound allows; the rest stay uncovered, and
  their keys are never copied out of Arrow. So a restart on a busy stream's backlog (an hour at 1,500 events/s
  is 5.4 million ids) holds the bound, not the hour (``benchmarks/known_keys.py``).
- without ``time_column`` (or with one that is not a timestamp, or for a batch with no time at all) the covered
  range is the whole table, kept whole: past ``max_keys`` it is dropped and scanned again by the next batch.
"""

from __future__ import annotations

import datetime as dt
import itertools
import mmap
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyiceberg.expressions import AlwaysTrue, And, GreaterThanOrEqual, LessThan
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Operation, Snapshot, ancestors_of

__all__ = ["KnownKeys", "KnownKeysStats"]

# Scans ``columns`` of ``table`` at ``snapshot_id`` under ``row_filter`` (the committer's scan).
ColumnScan = Callable[[Table, int, Any, Sequence[str]], pa.Table]

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_UNITS_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
_WHOLE_TABLE = "whole table"  # the one bucket when the covered range is everything
_NO_TIME = "no time"  # followed rows whose time is null (a range scan never returns them)


class KnownKeysStats:
    """What the known keys cost: scans of a range, data files read, resets, minutes dropped, the most keys held (all
    since creation)."""

    def __init__(self) -> None:
        self.scans = 0
        self.files_read = 0
        self.resets = 0
        self.evicted_buckets = 0
        self.peak_keys = 0  # the most keys held at once (the memory bound: ``max_keys`` plus one batch's minutes)


class KnownKeys:
    """The values of ``key_column`` in a table, over the covered minutes of ``time_column`` (the whole table without
    one), as of one snapshot. ``new_rows(table, base, batch)`` returns the batch's rows whose key is not there."""

    def __init__(
        self,
        key_column: str,
        time_column: str | None,
        scan: ColumnScan,
        max_keys: int = 1_000_000,
        bucket_s: int = 60,
        widen_s: int = 3600,
        max_empty: int = 1440,
    ) -> None:
        if bucket_s <= 0 or widen_s % bucket_s:
            raise ValueError(f"bucket_s ({bucket_s}) must be positive and divide widen_s ({widen_s})")
        self.key_column = key_column
        self.time_column = time_column
        self.max_keys = max_keys
        self.bucket_s = bucket_s
        self.widen_s = widen_s
        self.max_empty = max_empty
        self.stats = KnownKeysStats()
        self._scan = scan
        # Covered buckets (minutes since the epoch, or _WHOLE_TABLE / _NO_TIME) -> their keys, sorted and unique, in
        # one numpy array each (``_encode``). A key has one time (``IcebergCommitter``'s contract for
        # key_time_column), so it is in one bucket, and a row's key is looked up in its own minute only.
        self._buckets: dict[Any, np.ndarray] = {}
        self._held = 0  # keys in all buckets
        self._snapshot_id: int | None = None  # the snapshot the keys are as of (None: nothing known)
        # Which batch last needed each covered bucket (or covered it by a scan): what the bounds drop first is what
        # the batches needed least recently.
        self._batches = 0
        self._needed_at: dict[Any, int] = {}

    def __len__(self) -> int:
        return self._held

    @property
    def covered_buckets(self) -> int:
        """How many minutes (or whole-table ranges) are covered now, empty ones included."""
        return len(self._buckets)

    def reset(self) -> None:
        if self._snapshot_id is not None:
            self.stats.resets += 1
        self._buckets = {}
        self._needed_at = {}
        self._held = 0
        self._snapshot_id = None

    def new_rows(self, table: Table, base: Snapshot, batch: pa.Table) -> pa.Table:
        """The rows of ``batch`` whose key the table does not hold at ``base`` (which must be the table's head)."""
        if batch[self.key_column].null_count:  # the committer refuses such rows first; a key is what is looked up
            raise ValueError(f"rows without a value in the key column {self.key_column!r}")
        self._follow(table, base)
        self._batches += 1
        groups = self._grouped(batch) if self._timed(batch) else []
        kind = batch[self.time_column].type if groups else None
        needed = self._cover(table, base, {bucket for bucket, _ in groups if bucket != _NO_TIME}, kind)
        self._needed_at.update(dict.fromkeys(needed, self._batches))
        keys = batch[self.key_column]
        held = self._buckets
        if _WHOLE_TABLE in needed:
            known = _contains(held[_WHOLE_TABLE], _encode(keys))
        else:
            known = np.zeros(batch.num_rows, np.bool_)
            for bucket, rows in groups:
                encoded = _encode(keys, rows)
                if bucket != _NO_TIME:
                    known[rows] = _contains(held[bucket], encoded)
                    continue
                for others in held.values():  # a row without a time may have any: every bucket held answers
                    known[rows] |= _contains(others, encoded)
        self._trim(needed)
        return batch.filter(pa.array(~known))

    def committed(self, parent: Snapshot, snapshot_id: int | None, batch: pa.Table) -> None:
        """Our own commit of ``batch`` on ``parent`` became ``snapshot_id``: known without reading it back."""
        if self._snapshot_id != parent.snapshot_id or snapshot_id is None:
            self.reset()
            return
        self._add(batch)  # its buckets were covered by ``new_rows`` just before
        self._snapshot_id = snapshot_id

    # ---- buckets ---------------------------------------------------------------------------------------------------

    def _timed(self, batch: pa.Table) -> bool:
        """Whether ``batch`` has the time column as timestamps (minutes need a time of day; a date column, say, is
        covered as the whole table instead)."""
        column = self.time_column
        return column is not None and column in batch.column_names and pa.types.is_timestamp(batch[column].type)

    def _bucket_numbers(self, column: Any) -> Any:
        """Each value's minute (``bucket_s``) since the epoch as a numpy array, floored (times before 1970 too); a
        null's number is meaningless (the caller masks it)."""
        width = self.bucket_s * _UNITS_PER_SECOND[column.type.unit]
        micros = pc.cast(column, pa.int64()).fill_null(0)
        return np.floor_divide(micros.to_numpy(), width)

    def _grouped(self, rows: pa.Table) -> list[tuple[Any, np.ndarray]]:
        """The row numbers of ``rows`` per bucket (``_NO_TIME`` for rows without a time). Only numbers: a bucket's
        keys are copied out of Arrow (``_encode``) only when it is kept."""
        if not self._timed(rows):  # a file written without the time column: its rows have no time
            return [(_NO_TIME, np.arange(rows.num_rows))] if rows.num_rows else []
        column = rows[self.time_column]
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        groups: list[tuple[Any, np.ndarray]] = []
        if column.null_count:
            groups.append((_NO_TIME, np.flatnonzero(~valid)))
        timed = np.flatnonzero(valid)
        if not len(timed):
            return groups
        numbers = self._bucket_numbers(column)[timed]
        order = np.argsort(numbers, kind="stable")
        numbers, timed = numbers[order], timed[order]
        bounds = [0, *(np.flatnonzero(np.diff(numbers)) + 1).tolist(), len(numbers)]  # where each bucket starts
        for begin, end in itertools.pairwise(bounds):
            groups.append((int(numbers[begin]), timed[begin:end]))
        return groups

    def _add(self, rows: pa.Table) -> None:
        """Adds the keys of ``rows`` to the covered buckets they fall in (the others are not needed yet)."""
        keys = rows[self.key_column]
        if _WHOLE_TABLE in self._buckets:
            self._hold(_WHOLE_TABLE, _encode(keys))
            return
        for bucket, numbers in self._grouped(rows):
            if bucket == _NO_TIME or bucket in self._buckets:
                self._hold(bucket, _encode(keys, numbers))

    def _hold(self, bucket: Any, keys: np.ndarray) -> None:
        """Merges ``keys`` into ``bucket``'s sorted array (covering it if it was not)."""
        held = self._buckets.get(bucket)
        merged = _merged(held, keys)
        self._buckets[bucket] = merged
        self._held += len(merged) - (0 if held is None else len(held))
        self.stats.peak_keys = max(self.stats.peak_keys, self._held)

    def _trim(self, needed: set[Any]) -> None:
        """Drops the buckets the batches needed least recently (and the batch does not need) until at most
        ``max_keys`` keys and ``max_empty`` empty minutes are held."""
        buckets = self._buckets
        if self._held > self.max_keys:
            if _WHOLE_TABLE in buckets:
                self.reset()  # the whole table is one range: it is kept whole or not at all
                return
            # _NO_TIME first: a range scan never brings those keys back, so they go before any minute does. An empty
            # minute frees nothing here; the count of those is bounded below.
            order = sorted(
                (b for b in buckets if b not in needed and b != _NO_TIME and len(buckets[b])), key=self._staleness
            )
            if _NO_TIME in buckets and _NO_TIME not in needed:
                order.insert(0, _NO_TIME)
            for bucket in order:
                if self._held <= self.max_keys:
                    break
                self._drop(bucket)
                self.stats.evicted_buckets += 1
        if len(buckets) > self.max_empty:
            empty = [b for b, keys in buckets.items() if isinstance(b, int) and not len(keys) and b not in needed]
            if len(empty) > self.max_empty:
                empty.sort(key=self._staleness)
                for bucket in empty[: len(empty) - self.max_empty]:
                    self._drop(bucket)

    def _staleness(self, bucket: int) -> tuple[int, int]:
        """Drop order: the batch that last needed the minute, then the minute itself (the oldest first)."""
        return self._needed_at.get(bucket, 0), bucket

    def _drop(self, bucket: Any) -> None:
        self._held -= len(self._buckets.pop(bucket))
        self._needed_at.pop(bucket, None)

    # ---- following the table ---------------------------------------------------------------------------------------

    def _follow(self, table: Table, base: Snapshot) -> None:
        """Brings the keys from the known snapshot to ``base``: the files appended in between."""
        if self._snapshot_id is None or self._snapshot_id == base.snapshot_id:
            return
        newer: list[Snapshot] = []
        for snapshot in ancestors_of(base, table.metadata):
            if snapshot.snapshot_id == self._snapshot_id:
                break
            newer.append(snapshot)
        else:  # the known snapshot is not an ancestor of the head: expired, or history rewritten
            self.reset()
            return
        appended: set[int] = set()
        for snapshot in newer:
            operation = snapshot.summary.operation if snapshot.summary else None
            if operation == Operation.APPEND:
                appended.add(snapshot.snapshot_id)
            elif operation != Operation.REPLACE:  # rows may have been removed: start over
                self.reset()
                return
        paths: set[str] = set()
        for manifest in base.manifests(table.io):
            # A manifest written before a snapshot cannot list its files (merged manifests carry the merging
            # snapshot's id, and their entries keep the snapshot that added each file).
            if manifest.added_snapshot_id not in appended:
                continue
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                if entry.snapshot_id in appended:
                    paths.add(entry.data_file.file_path)
        columns = [self.key_column]
        if _WHOLE_TABLE not in self._buckets and self.time_column is not None:
            columns.append(self.time_column)
        for path in sorted(paths):
            with table.io.new_input(path).open() as stream:
                data = pq.ParquetFile(stream)
                names = data.schema_arrow.names
                self._add(data.read(columns=[c for c in columns if c in names]))
            self.stats.files_read += 1
        self._snapshot_id = base.snapshot_id

    def _cover(self, table: Table, base: Snapshot, needed: set[Any], kind: Any) -> set[Any]:
        """Scans the ``needed`` buckets not covered yet, at ``base`` (``kind``: the batch's timestamp type); returns
        the buckets the batch needs (the whole table when it needs no minute: a batch without times)."""
        self._snapshot_id = base.snapshot_id  # nothing known before (reset): nothing held either
        if _WHOLE_TABLE in self._buckets:
            return {_WHOLE_TABLE}
        if not needed:  # no time on any row: only the whole table answers
            self._buckets = {}
            self._needed_at = {}
            self._held = 0
            self._hold(_WHOLE_TABLE, _NOTHING)
            self._add(self._scan(table, base.snapshot_id, AlwaysTrue(), [self.key_column]))
            self.stats.scans += 1
            return {_WHOLE_TABLE}
        per_widen = self.widen_s // self.bucket_s
        missing: set[int] = set()
        for bucket in needed:
            if bucket in self._buckets:
                continue
            hour = bucket - bucket % per_widen
            if any(b in self._buckets for b in range(hour, hour + per_widen)):
                missing.add(bucket)
            else:
                missing.update(range(hour, hour + per_widen))
        for low, high in _runs(sorted(missing)):
            scanned = self._scan_range(table, base, self._between(low, high + 1, kind))
            self._cover_from(range(low, high + 1), scanned, needed)
        return needed

    def _cover_from(self, span: range, scanned: pa.Table, needed: set[Any]) -> None:
        """Covers the buckets of ``span`` with the keys a scan of it found: the batch's own first, then the newest,
        while the bound allows. A bucket left out stays uncovered (a batch that needs it scans just it), so the keys
        held stay near ``max_keys`` even when the scanned hour holds millions of rows (a restart on a backlog of a
        busy stream); before, the whole hour was held until the batch was done."""
        found = {bucket: rows for bucket, rows in self._grouped(scanned) if bucket != _NO_TIME}
        keys = scanned[self.key_column]
        full = False
        for bucket in sorted(span, key=lambda b: (b not in needed, -b)):
            rows = found.get(bucket)
            if rows is None:  # an empty minute costs nothing to cover (the rest of the hour a stream is writing)
                self._hold(bucket, _NOTHING)
                self._needed_at[bucket] = self._batches
                continue
            # Past the bound, older minutes than this one stay uncovered too: the newest stretch is what streams need.
            full = full or (bucket not in needed and self._held + len(rows) > self.max_keys)
            if bucket in needed or not full:
                self._hold(bucket, _encode(keys, rows))
                self._needed_at[bucket] = self._batches

    def _between(self, low: int, high: int, kind: Any) -> Any:
        """``time_column`` in [start of bucket ``low``, start of bucket ``high``)."""
        column = self.time_column
        assert column is not None
        lower = GreaterThanOrEqual(column, _literal(self._bucket_start(low, kind)))
        return And(lower, LessThan(column, _literal(self._bucket_start(high, kind))))

    def _bucket_start(self, bucket: int, kind: Any) -> dt.datetime:
        start = _EPOCH + dt.timedelta(seconds=bucket * self.bucket_s)
        return start if kind.tz is not None else start.replace(tzinfo=None)

    def _scan_range(self, table: Table, base: Snapshot, row_filter: Any) -> pa.Table:
        assert self.time_column is not None
        self.stats.scans += 1
        return self._scan(table, base.snapshot_id, row_filter, [self.key_column, self.time_column])


# ---- keys as sorted fixed-width arrays ------------------------------------------------------------------------------

_NOTHING = np.empty(0, np.int64)  # an empty bucket (covered, no keys)
_MAPPED_BYTES = 256 * 1024  # a held array this large is mapped on its own (``_held_array``)


def _encode(column: Any, rows: np.ndarray | None = None) -> np.ndarray:
    """The non-null keys of an Arrow column (those at ``rows`` if given) as one numpy array, exactly: integers as
    integers; strings and bytes as fixed-width bytes (``S<w>``) with a ``\\x01`` after each key, because numpy's
    byte strings ignore trailing NULs (``a`` and ``a\\x00`` would be one key without it); other types as their
    string form. Built from Arrow's buffers, with no Python object per key: a million 32-character event ids are 33 MB
    in one array, where a Python set of them was about 120 MB of small objects."""
    if rows is not None:
        column = column.take(pa.array(rows))
    values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if values.null_count:  # the committer refuses rows without a key; a table written by others may hold some
        values = values.drop_null()
    kind = values.type
    if pa.types.is_integer(kind):
        return np.asarray(values.to_numpy(zero_copy_only=False))
    large = pa.types.is_large_string(kind) or pa.types.is_large_binary(kind)
    if not (large or pa.types.is_string(kind) or pa.types.is_binary(kind)):
        values = pc.cast(values, pa.large_string())
        large = True
    count = len(values)
    if not count:
        return _NOTHING
    buffers = values.buffers()
    offsets = np.frombuffer(buffers[1], np.int64 if large else np.int32)[values.offset : values.offset + count + 1]
    first, last = int(offsets[0]), int(offsets[-1])
    data = np.frombuffer(buffers[2], np.uint8)[first:last] if last > first else np.empty(0, np.uint8)
    lengths = np.diff(offsets)
    width = int(lengths.max()) + 1
    packed = np.zeros((count, width), np.uint8)
    if (lengths == lengths[0]).all():  # event ids: one length, a reshape
        packed[:, : width - 1] = data.reshape(count, width - 1)
    else:
        row_of_byte = np.repeat(np.arange(count), lengths)
        starts: np.ndarray = np.repeat(offsets[:-1] - first, lengths)  # each byte's key's first byte
        packed[row_of_byte, np.arange(last - first) - starts] = data
    packed[np.arange(count), lengths] = 1
    return packed.view(f"S{width}").ravel()


def _contains(held: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each of ``keys``, whether it is in ``held`` (sorted, unique)."""
    if not len(held) or not len(keys):
        return np.zeros(len(keys), np.bool_)
    at = np.minimum(np.searchsorted(held, keys), len(held) - 1)
    return np.asarray(held[at] == keys, np.bool_)


def _merged(held: np.ndarray | None, keys: np.ndarray) -> np.ndarray:
    """``held`` (sorted, unique) with ``keys`` added, in a new array (``_held_array``): one pass, not a sort of the
    whole bucket."""
    keys = np.unique(keys)
    if held is None or not len(held):
        if not len(keys):
            return _NOTHING
        held = _held_array(len(keys), keys.dtype)
        held[:] = keys
        return held
    if not len(keys):
        return held
    kind = np.promote_types(held.dtype, keys.dtype)  # a wider key must not be cut to the bucket's width
    widened, keys = held.astype(kind, copy=False), keys.astype(kind, copy=False)
    keys = keys[~_contains(widened, keys)]
    if not len(keys):
        return held  # the bucket's own array: a widened copy would live on the heap
    merged = _held_array(len(widened) + len(keys), kind)
    added_at = np.searchsorted(widened, keys) + np.arange(len(keys))  # each new key's place in the merged array
    taken = np.zeros(len(merged), np.bool_)
    taken[added_at] = True
    merged[added_at] = keys
    merged[~taken] = widened
    return merged


def _held_array(count: int, kind: np.dtype) -> np.ndarray:
    """An uninitialised array of ``count`` keys to hold. One of 256 KB or more gets an anonymous mapping of its own,
    returned to the system when the array is dropped. From the heap instead, the current minute's array, replaced by
    one a commit larger at every commit, left holes that no later array fits: glibc held them as free memory, +2 MB a
    minute per worker in a soak (``docs/streaming.md``)."""
    size = count * kind.itemsize
    if size < _MAPPED_BYTES:
        return np.empty(count, kind)
    return np.frombuffer(mmap.mmap(-1, size), kind, count)


def _literal(value: dt.datetime) -> str:
    """pyiceberg 0.8 literals take no datetime; an ISO string converts to the column's timestamp type."""
    return value.isoformat()


def _runs(buckets: list[int]) -> list[tuple[int, int]]:
    """Sorted bucket numbers as runs of consecutive ones, each (first, last)."""
    runs: list[tuple[int, int]] = []
    for bucket in buckets:
        if runs and bucket == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], bucket)
        else:
            runs.append((bucket, bucket))
    return runs
