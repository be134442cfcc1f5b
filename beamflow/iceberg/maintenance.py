"""Table maintenance that is safe while a sink commits: expire snapshots, compact small files.

Both are optimistic like the sink: each attempt loads the table, prepares its change against the current head
and commits with the requirement that the head has not moved (``AssertRefSnapshotId``); if the sink (or
anyone) committed in between, the catalog rejects it and the attempt starts over (a compaction keeps the files it
wrote while the ones they replace are still live, ``compact_files``). Neither adds or removes
rows, so a race can delay them but never lose or double data, and the sink's marks survive because they also
live in a table property.

pyiceberg 0.8.1 has no expire-snapshots API and no ``RemoveSnapshotsUpdate`` handler, so this module registers
one on pyiceberg's own update dispatcher (only if pyiceberg lacks it) and commits it through a normal
transaction. Files only the expired snapshots referenced stay on disk: deleting them while writers run needs
an orphan-file sweep with a grace period, which is out of scope here.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy.exc
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files
from pyiceberg.manifest import ManifestContent
from pyiceberg.table import Table, TableProperties
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Operation, ancestors_of
from pyiceberg.table.update import (
    AssertRefSnapshotId,
    RemoveSnapshotsUpdate,
    _apply_table_update,
    _TableMetadataUpdateContext,
)
from pyiceberg.utils.datetime import datetime_to_millis

from beamflow.iceberg.committer import decode_marks, encode_marks, merge_marks

__all__ = ["CompactResult", "ExpireResult", "compact_files", "expire_snapshots"]

log = logging.getLogger(__name__)

_MARKS_PREFIX = "beamflow.sink."
_MARKS_SUFFIX = ".marks"


def _remove_snapshots(
    update: RemoveSnapshotsUpdate, base_metadata: TableMetadata, context: _TableMetadataUpdateContext
) -> TableMetadata:
    removing = set(update.snapshot_ids)
    referenced = {ref.snapshot_id for ref in base_metadata.refs.values()}
    if removing & referenced:
        raise CommitFailedException(
            f"cannot expire snapshots still referenced by a branch or tag: {removing & referenced}"
        )
    context.add_update(update)
    return base_metadata.model_copy(
        update={
            "snapshots": [s for s in base_metadata.snapshots if s.snapshot_id not in removing],
            "snapshot_log": [e for e in base_metadata.snapshot_log if e.snapshot_id not in removing],
            "last_updated_ms": datetime_to_millis(datetime.now().astimezone()),
        }
    )


if RemoveSnapshotsUpdate not in _apply_table_update.registry:
    _apply_table_update.register(RemoveSnapshotsUpdate)(_remove_snapshots)


def _retrying(what: str, attempt_fn: Callable[[], Any], max_attempts: int) -> tuple[Any, int]:
    for attempt in range(1, max_attempts + 1):
        try:
            return attempt_fn(), attempt
        except (CommitFailedException, sqlalchemy.exc.OperationalError) as exc:
            log.info("%s attempt %d lost a race (%s); trying again", what, attempt, exc)
            time.sleep(min(2.0, 0.05 * attempt) * (0.5 + random.random()))
    raise CommitFailedException(f"{what}: gave up after {max_attempts} attempts")


@dataclass
class ExpireResult:
    expired: list[int] = field(default_factory=list)
    kept: int = 0
    attempts: int = 0
    marks_saved: dict[str, str] = field(default_factory=dict)


def _sink_marks_in_summaries(table: Table) -> dict[str, str]:
    """Each sink's newest marks in the ancestry merged with its table property, where that changes it."""
    newest: dict[str, str] = {}
    for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
        extra = snapshot.summary.additional_properties if snapshot.summary is not None else {}
        for key, value in extra.items():
            if key.startswith(_MARKS_PREFIX) and key.endswith(_MARKS_SUFFIX) and key not in newest:
                newest[key] = value
    merged: dict[str, str] = {}
    for key, value in newest.items():
        combined = encode_marks(merge_marks(decode_marks(value), decode_marks(table.properties.get(key))))
        if combined != table.properties.get(key):
            merged[key] = combined
    return merged


def expire_snapshots(
    load_table: Callable[[], Table],
    keep_last: int = 1,
    older_than_ms: int | None = None,
    max_attempts: int = 50,
) -> ExpireResult:
    """Removes snapshots from the metadata: all but the newest ``keep_last`` of the current ancestry, and (if
    given) only those committed before ``older_than_ms`` (epoch millis). Snapshots a branch or tag points at
    are kept.

    Before the summaries go, each sink's marks are merged into its table property in the same commit, so a
    sink's replay protection never depends on snapshot history.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1 (the current snapshot)")
    result = ExpireResult()

    def attempt() -> None:
        table = load_table()
        current = table.current_snapshot()
        if current is None:
            return
        keep = {s.snapshot_id for s in list(ancestors_of(current, table.metadata))[:keep_last]}
        keep |= {ref.snapshot_id for ref in table.metadata.refs.values()}
        doomed = [
            s.snapshot_id
            for s in table.metadata.snapshots
            if s.snapshot_id not in keep and (older_than_ms is None or s.timestamp_ms < older_than_ms)
        ]
        result.kept = len(table.metadata.snapshots) - len(doomed)
        result.expired = doomed
        if not doomed:
            return
        saved = _sink_marks_in_summaries(table)
        result.marks_saved = saved
        tx = table.transaction()
        if saved:
            tx.set_properties(saved)
        tx._apply(
            (RemoveSnapshotsUpdate.model_validate({"snapshot-ids": doomed}),),
            (AssertRefSnapshotId.model_validate({"ref": "main", "snapshot-id": current.snapshot_id}),),
        )
        tx.commit_transaction()

    _, result.attempts = _retrying("expire snapshots", attempt, max_attempts)
    return result


@dataclass
class CompactResult:
    files_removed: int = 0
    files_added: int = 0
    rows_rewritten: int = 0
    bytes_removed: int = 0
    attempts: int = 0
    rewrites: int = 0  # how often the data was read and written; more than one only when a rewrite was invalidated
    snapshot_id: int | None = None


@dataclass
class _Rewrite:
    """One read-and-write of small files: which files it replaces with which, based on which snapshot."""

    base_snapshot_id: int
    schema_id: int
    spec_id: int
    removed: list[Any] = field(default_factory=list)
    added: list[Any] = field(default_factory=list)
    rows: int = 0


def _still_valid(table: Table, rewrite: _Rewrite) -> bool:
    """Whether every file ``rewrite`` replaces is still live, unchanged, at the table's head (same schema and spec).

    Known from the snapshots' operations when the head descends from the rewrite's base through appends only (a
    sink's commits): an append adds files and removes none. When the base has been expired from the history (a sink
    expiring its own snapshots as it commits), the head's manifests are read instead: every replaced file still
    listed and no delete files anywhere. Anything else (another compaction, a delete) sends the rewrite back to a
    fresh read."""
    head = table.current_snapshot()
    if head is None or table.schema().schema_id != rewrite.schema_id or table.spec().spec_id != rewrite.spec_id:
        return False
    for snapshot in ancestors_of(head, table.metadata):
        if snapshot.snapshot_id == rewrite.base_snapshot_id:
            return True
        if snapshot.summary is None or snapshot.summary.operation != Operation.APPEND:
            return False
    live: set[str] = set()
    for manifest in head.manifests(table.io):
        if manifest.content != ManifestContent.DATA:
            return False
        live.update(e.data_file.file_path for e in manifest.fetch_manifest_entry(table.io, discard_deleted=True))
    return all(f.file_path in live for f in rewrite.removed)


def compact_files(
    load_table: Callable[[], Table],
    small_file_bytes: int = 32 * 1024 * 1024,
    min_input_files: int = 2,
    max_group_bytes: int = 512 * 1024 * 1024,
    max_attempts: int = 50,
    sort_by: str | None = None,
    row_group_rows: int | None = None,
) -> CompactResult:
    """Rewrites data files smaller than ``small_file_bytes`` into larger ones, per partition, in one overwrite
    commit.

    Groups with fewer than ``min_input_files`` small files are left alone; a group is read into memory, so
    ``max_group_bytes`` (of Parquet input) bounds it. Files with delete files attached are skipped. The commit
    deletes exactly the files it read and adds the rewritten ones, with the requirement that the head has not moved.

    A streaming sink commits about once a second per subtask, and reading and writing a day's small files takes
    longer, so a compaction that started over from a fresh read after every lost race never committed beside a
    running job (a soak's compaction gave up after 50 attempts). A lost race now keeps the written files and
    commits them again on the new head when the files it replaces are still live there (``_still_valid``: only
    appends since its base), and only the commit, not the read and write, races the sink. Anything else
    since the base starts over from a fresh read. Either way rows are never lost or doubled.

    ``sort_by`` (a column) orders each group's rows before they are written. Without it a rewritten file holds its
    inputs' rows in input order, so every row group spans the partition's whole range of that column and a scan
    filtered on it (the sink's key lookup by event time) reads the whole file where the small files were pruned.
    ``row_group_rows`` bounds the rewritten files' row groups (default: the table's
    ``write.parquet.row-group-limit``, pyiceberg's 1,048,576 rows): a scan reads whole row groups, so sorted rows
    prune only as finely as their groups. The sink's own commits are far smaller than either.
    """
    if row_group_rows is not None and row_group_rows < 1:
        raise ValueError("row_group_rows must be at least 1")
    result = CompactResult()
    prepared: list[_Rewrite] = []  # the last attempt's rewrite, kept for the next attempt when still valid

    def attempt() -> None:
        table = load_table()
        if not (prepared and _still_valid(table, prepared[0])):
            prepared[:] = []
            rewrite = _read_and_write(
                table, small_file_bytes, min_input_files, max_group_bytes, sort_by, row_group_rows
            )
            if rewrite is None:
                current = table.current_snapshot()
                result.snapshot_id = current.snapshot_id if current else None
                return
            result.rewrites += 1
            prepared.append(rewrite)
        rewrite = prepared[0]
        tx = table.transaction()
        with tx.update_snapshot(snapshot_properties={"beamflow.maintenance": "compact"}).overwrite() as overwrite:
            for data_file in rewrite.removed:
                overwrite.delete_data_file(data_file)
            for data_file in rewrite.added:
                overwrite.append_data_file(data_file)
        committed = tx.commit_transaction()
        snap = committed.current_snapshot()
        result.snapshot_id = snap.snapshot_id if snap else None
        result.files_removed, result.files_added = len(rewrite.removed), len(rewrite.added)
        result.rows_rewritten = rewrite.rows
        result.bytes_removed = sum(f.file_size_in_bytes for f in rewrite.removed)

    _, result.attempts = _retrying("compact files", attempt, max_attempts)
    return result


def _read_and_write(
    table: Table,
    small_file_bytes: int,
    min_input_files: int,
    max_group_bytes: int,
    sort_by: str | None,
    row_group_rows: int | None,
) -> _Rewrite | None:
    """Reads the head's groups of small files and writes each group's rows as new files (not yet committed)."""
    current = table.current_snapshot()
    if current is None:
        return None
    groups: dict[tuple[int, str], list[Any]] = {}
    for task in table.scan(snapshot_id=current.snapshot_id).plan_files():
        data_file = task.file
        if task.delete_files or data_file.file_size_in_bytes >= small_file_bytes:
            continue
        groups.setdefault((data_file.spec_id, repr(data_file.partition)), []).append(task)
    chosen = []
    for tasks in groups.values():
        tasks.sort(key=lambda t: t.file.file_size_in_bytes)
        batch: list[Any] = []
        size = 0
        for task in tasks:
            if batch and size + task.file.file_size_in_bytes > max_group_bytes:
                if len(batch) >= min_input_files:
                    chosen.append(batch)
                batch, size = [], 0
            batch.append(task)
            size += task.file.file_size_in_bytes
        if len(batch) >= min_input_files:
            chosen.append(batch)
    if not chosen:
        return None
    rewrite = _Rewrite(current.snapshot_id, table.schema().schema_id, table.spec().spec_id)
    metadata = table.metadata  # what pyiceberg's writer reads its settings from, the row group limit among them
    if row_group_rows is not None:
        limit = {TableProperties.PARQUET_ROW_GROUP_LIMIT: str(row_group_rows)}
        metadata = metadata.model_copy(update={"properties": {**metadata.properties, **limit}})
    write_uuid = uuid.uuid4()
    counter = itertools.count(0)  # one numbering for all groups: file names must not repeat within a rewrite
    for group in chosen:
        rows = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue()).to_table(group)
        if sort_by is not None:
            rows = rows.sort_by(sort_by)
        rewrite.removed += [task.file for task in group]
        rewrite.added += _dataframe_to_data_files(
            table_metadata=metadata, df=rows, io=table.io, write_uuid=write_uuid, counter=counter
        )
        rewrite.rows += rows.num_rows
    return rewrite
