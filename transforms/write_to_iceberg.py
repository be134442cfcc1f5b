"""``WriteToIceberg``: exactly-once appends of Kafka-sourced dict rows to an Iceberg table."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import apache_beam as beam
import pyarrow as pa
from apache_beam import pvalue
from apache_beam.metrics import Metrics

from beamflow.deadletter import DeadLetter, encode_payload
from beamflow.iceberg.catalog import CatalogConfig, open_catalog
from beamflow.iceberg.committer import (
    DEFAULT_COORDINATES,
    CommitResult,
    CoordinateFields,
    IcebergCommitter,
    SchemaEvolutionError,
    marks_property,
)
from beamflow.iceberg.known_keys import KnownKeys
from transforms.sink_base import DEAD_LETTERS, WRITTEN, Declared, Guarantee, SinkFn, SinkResult

__all__ = ["WriteToIceberg"]

log = logging.getLogger(__name__)

# A batch failing with these is bad data (a type clash, a refused schema change), not a transient failure.
_DATA_ERRORS = (SchemaEvolutionError, pa.ArrowInvalid, pa.ArrowTypeError)
_STAGE = "WriteToIceberg"
METRICS_NAMESPACE = "beamflow.iceberg"


class _CommitMetrics:
    """Beam metrics of one worker's committer, reported once per commit (Flink shows them per subtask): commits and
    rows by outcome, and the known keys' scans, files followed, resets, minutes dropped (counters) and keys held
    (gauge). A scan per commit, or keys held at ``known_keys_max`` with minutes dropped at every commit, is the
    lookup going back to what a stream cannot afford (``beamflow/iceberg/known_keys.py``)."""

    COUNTERS = (
        "commits",
        "rows_written",
        "rows_existing_key",
        "rows_below_marks",
        "rows_duplicate_in_batch",
        "known_keys_scans",
        "known_keys_files_read",
        "known_keys_resets",
        "known_keys_evicted_minutes",
    )

    def __init__(self) -> None:
        self.counters = {name: Metrics.counter(METRICS_NAMESPACE, name) for name in self.COUNTERS}
        self.held = Metrics.gauge(METRICS_NAMESPACE, "known_keys_held")
        self._known = (0, 0, 0, 0)  # the known keys' stats at the last report (they count since creation)

    def report(self, result: CommitResult, known_keys: KnownKeys | None) -> None:
        counters = self.counters
        counters["commits"].inc()
        for name in ("rows_written", "rows_existing_key", "rows_below_marks", "rows_duplicate_in_batch"):
            if value := getattr(result, name):
                counters[name].inc(value)
        if known_keys is None:
            return
        stats = known_keys.stats
        now = (stats.scans, stats.files_read, stats.resets, stats.evicted_buckets)
        names = ("known_keys_scans", "known_keys_files_read", "known_keys_resets", "known_keys_evicted_minutes")
        for name, value, before in zip(names, now, self._known, strict=True):
            if value > before:
                counters[name].inc(value - before)
        self._known = now
        self.held.set(len(known_keys))


def _coordinates_of(row: Mapping[str, Any], fields: CoordinateFields) -> tuple[Any, Any, Any]:
    nested = row.get(fields.nested)
    if isinstance(nested, Mapping):
        return nested.get("topic"), nested.get("partition"), nested.get("offset")
    return row.get(fields.topic), row.get(fields.partition), row.get(fields.offset)


class _CheckRow(beam.DoFn):
    """Passes good rows on; bad rows become dead letters with a reason (nothing is dropped silently)."""

    def __init__(self, fields: CoordinateFields, key_column: str | None) -> None:
        self.fields = fields
        self.key_column = key_column

    def process(self, row: Any) -> Iterator[Any]:
        if not isinstance(row, Mapping):
            yield pvalue.TaggedOutput(
                DEAD_LETTERS, _dead(row, f"expected a dict row, got {type(row).__name__}", "NotADict")
            )
            return
        topic, partition, offset = _coordinates_of(row, self.fields)
        has_all = topic is not None and partition is not None and offset is not None
        has_any = topic is not None or partition is not None or offset is not None
        if self.key_column is not None:
            if row.get(self.key_column) is None:
                yield pvalue.TaggedOutput(
                    DEAD_LETTERS, _dead(row, f"no value in key column {self.key_column!r}", "NoKey")
                )
                return
            if has_any and not has_all:
                yield pvalue.TaggedOutput(
                    DEAD_LETTERS, _dead(row, "only some Kafka coordinates present", "PartialCoords")
                )
                return
        elif not has_all:
            yield pvalue.TaggedOutput(
                DEAD_LETTERS,
                _dead(
                    row,
                    "no Kafka coordinates (topic, partition, offset) and no key_column: a replay of this row"
                    " could not be recognised",
                    "NoCoordinates",
                ),
            )
            return
        if has_all and (not isinstance(partition, int) or not isinstance(offset, int) or offset < 0):
            yield pvalue.TaggedOutput(
                DEAD_LETTERS, _dead(row, "partition and offset must be non-negative ints", "BadCoords")
            )
            return
        yield row if type(row) is dict else dict(row)  # nothing downstream mutates it: no copy per row


def _dead(row: Any, reason: str, error: str) -> DeadLetter:
    topic = partition = offset = None
    if isinstance(row, Mapping):
        t, p, o = _coordinates_of(row, DEFAULT_COORDINATES)
        topic = t if isinstance(t, str) else None
        partition = p if isinstance(p, int) else None
        offset = o if isinstance(o, int) else None
    return DeadLetter(
        payload=encode_payload(row),
        stage=_STAGE,
        reason=reason,
        topic=topic,
        partition=partition,
        offset=offset,
        error=error,
    )


class _Committing:
    """The committer of one table and how a batch is committed (split around bad rows), for both commit paths."""

    def __init__(
        self,
        catalog_config: CatalogConfig,
        table: str,
        sink_id: str,
        key_column: str | None,
        partition_by: Sequence[tuple[str, str]],
        fields: CoordinateFields,
        expire_keep_last: int | None,
        expire_every: int,
        max_batch_rows: int,
        key_time_column: str | None = None,
        known_keys_max: int = 1_000_000,
    ) -> None:
        super().__init__()
        self.catalog_config = catalog_config
        self.key_time_column = key_time_column
        self.known_keys_max = known_keys_max
        self.max_batch_rows = max(1, max_batch_rows)
        self.table = table
        self.sink_id = sink_id
        self.key_column = key_column
        self.partition_by = list(partition_by)
        self.fields = fields
        self.expire_keep_last = expire_keep_last
        self.expire_every = max(1, expire_every)
        self._committer: IcebergCommitter | None = None
        self._commits = 0

    def open(self) -> None:
        self._committer = IcebergCommitter(
            open_catalog(self.catalog_config),
            self.table,
            self.sink_id,
            key_column=self.key_column,
            key_time_column=self.key_time_column,
            partition_by=self.partition_by,
            coordinates=self.fields,
            known_keys_max=self.known_keys_max,
        )
        self._metrics = _CommitMetrics()

    def _commit_or_split(self, rows: list[dict[str, Any]], split: bool) -> Iterator[Any]:
        """Commits the batch; if its data is bad, commits halves in offset order until the bad rows stand alone.

        Yields a report (a dict) per commit and a ``DeadLetter`` per refused row.

        Halves go in (topic, partition, offset) order so each commit covers a prefix of every partition's offsets:
        a later half never lifts a mark over rows an earlier half still has to write.
        """
        assert self._committer is not None
        try:
            result = self._committer.commit(rows)
        except _DATA_ERRORS as exc:
            if len(rows) == 1:
                yield _dead(rows[0], str(exc), type(exc).__name__)
                return
            if not split:
                rows = sorted(rows, key=self._order)
            mid = len(rows) // 2
            yield from self._commit_or_split(rows[:mid], split=True)
            yield from self._commit_or_split(rows[mid:], split=True)
            return
        self._commits += 1
        self._metrics.report(result, self._committer.known_keys)
        if self.expire_keep_last is not None and result.rows_written and self._commits % self.expire_every == 0:
            from beamflow.iceberg.maintenance import expire_snapshots

            expire_snapshots(self._committer.load, keep_last=self.expire_keep_last)
        yield {"table": self.table, "sink_id": self.sink_id, **asdict(result)}

    def _order(self, row: Mapping[str, Any]) -> tuple[str, int, int]:
        topic, partition, offset = _coordinates_of(row, self.fields)
        return (
            str(topic or ""),
            partition if isinstance(partition, int) else -1,
            offset if isinstance(offset, int) else -1,
        )


class _CommitBatches(_Committing, beam.DoFn):
    """Bounded input without a key column: commits each grouped batch of one table in offset-ordered chunks; the
    committer's retries make a repeated bundle harmless."""

    def setup(self) -> None:
        self.open()

    def process(self, keyed_batch: tuple[str, Iterable[dict[str, Any]]]) -> Iterator[Any]:
        # A bounded input arrives as one grouped iterable: commit it in chunks of max_batch_rows so data files and
        # commits stay the size of streaming batches (a streaming batch is already at most that size). The rows are
        # put in (topic, partition, offset) order first, so each chunk covers a prefix of every partition's offsets
        # and a later chunk never holds an offset at or below a mark an earlier chunk committed.
        _, rows = keyed_batch
        batch = list(rows)
        if len(batch) <= self.max_batch_rows:
            yield from self._tagged(self._commit_or_split(batch, split=False))
            return
        batch.sort(key=self._order)
        for start in range(0, len(batch), self.max_batch_rows):
            # A replayed copy sorts right after its original; the committer keeps the first row per coordinate.
            yield from self._tagged(self._commit_or_split(batch[start : start + self.max_batch_rows], split=True))

    @staticmethod
    def _tagged(outputs: Iterator[Any]) -> Iterator[Any]:
        for out in outputs:
            yield pvalue.TaggedOutput(DEAD_LETTERS, out) if isinstance(out, DeadLetter) else out


class _CommitPerBundle(_Committing, SinkFn):
    """Unbounded input, and bounded input with a key column: stages a bundle's rows, commits them before it ends.

    Why per bundle: a runner finalizes a bundle (and ``ReadFromKafka`` commits its offsets) only after the bundle's
    work is durable. Rows kept in state past the bundle (``GroupIntoBatches``) would let the group's committed
    offsets run ahead of the table; rows committed in ``finish_bundle`` never do. On Flink a bundle ends at every
    checkpoint (``finish_bundle_before_checkpointing``) and after ``max_bundle_time_ms``/``max_bundle_size``, so the
    commit cadence is the checkpoint cadence, as in Flink's own Iceberg sink. A batch is also committed as soon as
    ``max_batch_rows`` rows are staged.
    """

    GUARANTEE = Declared(
        Guarantee.EXACTLY_ONCE,
        "rows carrying Kafka coordinates read in offset order (or a deterministic key_column), a stable sink_id",
    )
    STAGE = _STAGE

    def open(self) -> None:
        super().open()
        self._staged: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> Iterable[Any]:
        self._staged.append(row)
        return self.flush() if len(self._staged) >= self.max_batch_rows else ()

    def flush(self) -> list[Any]:
        batch, self._staged = self._staged, []
        return list(self._commit_or_split(batch, split=False)) if batch else []


class WriteToIceberg(beam.PTransform):
    """Appends dict rows to an Iceberg table exactly once per Kafka record, via a pyiceberg SQL catalog.

    Delivery guarantee: **exactly-once into the table**, provided that (1) every row carries its Kafka
    coordinates — top-level ``topic``/``partition``/``offset`` fields or a ``_kafka`` sub-dict with those keys
    (names configurable with ``coordinates=CoordinateFields(...)``) — and offsets of a partition are committed
    in increasing order (as one Kafka source reading each partition in order produces them); (2) ``sink_id``
    is stable across restarts and redeployments (never a job or run id) and no other writer uses the same
    ``sink_id`` for different data. Replays, restarts without state, a second copy of the job and retried
    bundles are then harmless: each commit drops rows at or below the per-partition high-water marks stored in
    the table (snapshot summary and table property, written in the same atomic commit as the rows) and retries
    from scratch when another commit got in first.

    Rows without coordinates (e.g. window aggregates) need ``key_column``: a deterministic row key
    deduplicated against the table at commit time (idempotent per key). Rows that satisfy neither go to
    ``dead_letters`` with a reason. Give ``key_column`` (and ``key_time_column``, see ``IcebergCommitter``) also when
    a shuffle by another key sits between the source and this sink: offsets of one partition then arrive out of
    order, and the marks alone would drop a lower offset that arrives after a higher one was committed. Each
    worker's committer holds at most ``known_keys_max`` keys of that lookup in memory (plus one batch's; 33 MB a
    million 32-character ids, in sorted fixed-width arrays).

    On unbounded input each worker commits the rows of a bundle before the bundle ends (and whenever
    ``max_batch_rows`` are staged), so the Kafka source's offsets, committed when the runner finalizes the bundle
    after a checkpoint, never run ahead of the table. The commit cadence is therefore the runner's bundle cadence:
    on Flink set ``finish_bundle_before_checkpointing: true`` and ``max_bundle_time_ms`` to the checkpoint interval
    (``conf/flink.yaml`` does; ``beamflow doctor`` checks it), for one commit per worker per checkpoint. Concurrent
    commits of several workers retry against each other (optimistic concurrency). Bounded input (a backfill, the
    demo) with ``key_column`` is committed the same way (the keys, not the order of offsets, decide what is new);
    without ``key_column`` its rows are grouped once per table and committed at the end of the input in chunks of
    ``max_batch_rows``, in offset order, as the marks need.

    New optional columns in the rows are added to the table before writing; removals, renames, new required columns
    and type changes are refused: the batch is split (in offset order) until the offending rows stand alone, they go
    to ``dead_letters`` and the rest is committed. Returns a ``SinkResult``: each element of ``written`` reports one
    commit (``rows_written``, rows skipped as at/below the marks for replays, duplicates); ``dead_letters`` holds
    every refused row. Every ``expire_every`` commits, snapshots beyond ``expire_keep_last`` are expired (``None``:
    never; compaction is a separate job, ``beamflow iceberg compact``). A restarted source may seek to
    ``IcebergCommitter(...).committed_marks()`` + 1 instead of trusting Kafka group offsets.

    Example::

        import datetime as dt
        import tempfile
        import apache_beam as beam
        from beamflow.iceberg.catalog import CatalogConfig
        from runners.direct import local_options
        from transforms import WriteToIceberg

        # Production: CatalogConfig(warehouse="s3://...", uri="postgresql+psycopg2://user:pw@db/iceberg")
        catalog = CatalogConfig(warehouse=tempfile.mkdtemp())   # a SQLite catalog in the warehouse folder
        day = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
        rows = [{"user_id": f"u{i}", "event_time": day, "topic": "clicks", "partition": 0, "offset": i}
                for i in range(3)]
        with beam.Pipeline(options=local_options()) as p:
            result = p | beam.Create(rows) | WriteToIceberg(
                "analytics.impressions", catalog, sink_id="impressions-v1", partition_by=[("event_time", "day")]
            )
            result.written | beam.Map(lambda commit: print(commit["rows_written"]))   # 3

    Metrics (Beam, namespace ``beamflow.iceberg``, per commit): ``commits``, ``rows_written``,
    ``rows_existing_key``, ``rows_below_marks``, ``rows_duplicate_in_batch``, ``known_keys_scans``,
    ``known_keys_files_read``, ``known_keys_resets``, ``known_keys_evicted_minutes`` and the gauge
    ``known_keys_held``.

    Needs: a SQL catalog (SQLite for development, PostgreSQL in production) and a warehouse folder every
    worker can reach.
    """

    GUARANTEES = {"": _CommitPerBundle.GUARANTEE}

    def __init__(
        self,
        table: str,
        catalog_config: CatalogConfig,
        sink_id: str,
        key_column: str | None = None,
        partition_by: Sequence[tuple[str, str]] = (),
        coordinates: CoordinateFields = DEFAULT_COORDINATES,
        max_batch_rows: int = 100_000,
        expire_keep_last: int | None = 50,
        expire_every: int = 10,
        key_time_column: str | None = None,
        known_keys_max: int = 1_000_000,
    ) -> None:
        super().__init__()
        self.key_time_column = key_time_column
        self.known_keys_max = known_keys_max
        marks_property(sink_id)  # validates the id now, not on a worker
        self.table = table if "." in table else f"default.{table}"
        self.catalog_config = catalog_config
        self.sink_id = sink_id
        self.key_column = key_column
        self.partition_by = list(partition_by)
        self.coordinates = coordinates
        self.max_batch_rows = max_batch_rows
        self.expire_keep_last = expire_keep_last
        self.expire_every = expire_every

    def expand(self, rows: beam.PCollection) -> SinkResult:
        checked = rows | "CheckRows" >> beam.ParDo(_CheckRow(self.coordinates, self.key_column)).with_outputs(
            DEAD_LETTERS, main="rows"
        )
        commit_args = (
            self.catalog_config,
            self.table,
            self.sink_id,
            self.key_column,
            self.partition_by,
            self.coordinates,
            self.expire_keep_last,
            self.expire_every,
            self.max_batch_rows,
            self.key_time_column,
            self.known_keys_max,
        )
        if rows.is_bounded and self.key_column is None:
            # Bounded input deduplicated by the marks: one grouping per table puts the rows in offset order
            # before they are committed. With a key column no order is needed, and a grouping would only cost a
            # shuffle of every row.
            committed = (
                checked.rows
                | "KeyByTable"
                >> beam.Map(lambda row, table: (table, row), self.table).with_output_types(
                    beam.typehints.KV[str, beam.typehints.Dict[str, beam.typehints.Any]]
                )
                | "StagePerTable" >> beam.GroupByKey()
                | "Commit" >> beam.ParDo(_CommitBatches(*commit_args)).with_outputs(DEAD_LETTERS, main=WRITTEN)
            )
        else:
            committed = checked.rows | "CommitPerBundle" >> beam.ParDo(_CommitPerBundle(*commit_args)).with_outputs(
                DEAD_LETTERS, main=WRITTEN
            )
        dead = (checked[DEAD_LETTERS], committed[DEAD_LETTERS]) | "AllDeadLetters" >> beam.Flatten()
        return SinkResult(written=committed[WRITTEN], dead_letters=dead)
