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
- the covered time range is one interval of whole days; a batch reaching outside it scans only the missing part;
- ``max_keys`` bounds the memory (a million 32-character ids are about 120 MB in a Python set): past it the keys
  are dropped and the next batch scans its own range again. A job whose batches keep spanning more than that many
  rows of the table (a backlog of days, all re-touched) is back to a scan per commit, the earlier cost; a stream
  whose batches touch recent days only is reset now and then and rescans just those days.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyiceberg.expressions import AlwaysTrue, And, GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Operation, Snapshot, ancestors_of

__all__ = ["KnownKeys", "KnownKeysStats"]

# Scans the key column of ``table`` at ``snapshot_id`` under ``row_filter`` (the committer's scan).
KeyScan = Callable[[Table, int, Any], Iterable[Any]]


class KnownKeysStats:
    """What the known keys cost: scans of a range, data files read, resets (all since creation)."""

    def __init__(self) -> None:
        self.scans = 0
        self.files_read = 0
        self.resets = 0


def _literal(value: Any) -> Any:
    """pyiceberg 0.8 literals take no datetime; an ISO string converts to the column's timestamp type."""
    return value.isoformat() if hasattr(value, "isoformat") else value


def _whole_day(value: Any, end: bool) -> Any:
    """A time widened to its day's first (or last) microsecond: batches of a backlog all span about the same days,
    so covering whole days saves a scan of a sliver per batch (a sliver costs nearly what its day costs to plan)."""
    if isinstance(value, dt.datetime):
        start = value.replace(hour=0, minute=0, second=0, microsecond=0)
        return start + dt.timedelta(days=1, microseconds=-1) if end else start
    return value


class KnownKeys:
    """The values of ``key_column`` in a table, over a covered range of ``time_column`` (the whole table without
    one), as of one snapshot. ``new_rows(table, base, batch)`` returns the batch's rows whose key is not there."""

    def __init__(self, key_column: str, time_column: str | None, scan: KeyScan, max_keys: int = 1_000_000) -> None:
        self.key_column = key_column
        self.time_column = time_column
        self.max_keys = max_keys
        self.stats = KnownKeysStats()
        self._scan = scan
        self._keys: set[Any] = set()
        self._snapshot_id: int | None = None  # the snapshot the keys are as of (None: nothing known)
        self._range: tuple[Any, Any] | None = None  # covered [low, high] of time_column; (None, None): everything

    def reset(self) -> None:
        if self._snapshot_id is not None:
            self.stats.resets += 1
        self._keys = set()
        self._snapshot_id = None
        self._range = None

    def new_rows(self, table: Table, base: Snapshot, batch: pa.Table) -> pa.Table:
        """The rows of ``batch`` whose key the table does not hold at ``base`` (which must be the table's head)."""
        if len(self._keys) > self.max_keys:
            self.reset()
        self._follow(table, base)
        self._cover(table, base, batch)
        known = self._keys
        mask = pa.array([key not in known for key in batch[self.key_column].to_pylist()], pa.bool_())
        return batch.filter(mask)

    def committed(self, parent: Snapshot, snapshot_id: int | None, batch: pa.Table) -> None:
        """Our own commit of ``batch`` on ``parent`` became ``snapshot_id``: known without reading it back."""
        if self._snapshot_id != parent.snapshot_id or snapshot_id is None:
            self.reset()
            return
        self._keys.update(batch[self.key_column].to_pylist())
        self._snapshot_id = snapshot_id

    # ---- following the table -----------------------------------------------------------------------------------

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
        for path in sorted(paths):
            with table.io.new_input(path).open() as stream:
                keys = pq.read_table(stream, columns=[self.key_column])[self.key_column]
            self._keys.update(keys.to_pylist())
            self.stats.files_read += 1
        self._snapshot_id = base.snapshot_id

    def _cover(self, table: Table, base: Snapshot, batch: pa.Table) -> None:
        """Scans whatever part of the batch's time range the keys do not cover yet, at ``base``."""
        if self._snapshot_id is None:
            self._keys = set()
            self._range = None
        if self.time_column is None or self.time_column not in batch.column_names:
            if self._range != (None, None):
                self._add_scan(table, base, AlwaysTrue())
                self._range = (None, None)
            self._snapshot_id = base.snapshot_id
            return
        if self._range == (None, None):
            return
        low, high = (
            _whole_day(v.as_py(), end=i == 1) for i, v in enumerate(pc.min_max(batch[self.time_column]).values())
        )
        if low is None or high is None:  # no time on any row: only a full scan answers
            self._add_scan(table, base, AlwaysTrue())
            self._range = (None, None)
        elif self._range is None:
            self._add_scan(table, base, self._between(low, high, True, True))
            self._range = (low, high)
        else:
            covered_low, covered_high = self._range
            if low < covered_low:
                self._add_scan(table, base, self._between(low, covered_low, True, False))
            if high > covered_high:
                self._add_scan(table, base, self._between(covered_high, high, False, True))
            self._range = (min(low, covered_low), max(high, covered_high))
        self._snapshot_id = base.snapshot_id

    def _between(self, low: Any, high: Any, low_closed: bool, high_closed: bool) -> Any:
        column = self.time_column
        assert column is not None
        lower = GreaterThanOrEqual(column, _literal(low)) if low_closed else GreaterThan(column, _literal(low))
        upper = LessThanOrEqual(column, _literal(high)) if high_closed else LessThan(column, _literal(high))
        return And(lower, upper)

    def _add_scan(self, table: Table, base: Snapshot, row_filter: Any) -> None:
        self._keys.update(self._scan(table, base.snapshot_id, row_filter))
        self.stats.scans += 1
