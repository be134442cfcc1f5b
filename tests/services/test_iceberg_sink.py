"""The exactly-once Iceberg sink against real catalogs (SQLite file and the project's PostgreSQL) and local
warehouses.

Acceptance: a SIGKILLed writer plus a rerun with other batch boundaries, two racing committers, a replay after
expiring to one snapshot, compaction during commits, and the Beam transform replayed on the local runner: each
event once, no data file referenced twice.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Any

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.util import assert_that, equal_to

from beamflow.iceberg.audit import AuditReport, audit_table
from beamflow.iceberg.catalog import CatalogConfig, open_catalog
from beamflow.iceberg.committer import IcebergCommitter, SchemaEvolutionError, marks_property, read_marks
from beamflow.iceberg.maintenance import compact_files, expire_snapshots
from beamflow.services.paths import project_root
from runners.direct import local_options
from transforms.write_to_iceberg import METRICS_NAMESPACE, WriteToIceberg

pytestmark = pytest.mark.services

TABLE = "sink.events"
PARTITIONS = 4


def events(n: int, topic: str = "clicks", first_offset: int = 0, prefix: str = "e") -> list[dict[str, Any]]:
    """n events spread round-robin over PARTITIONS partitions, offsets increasing per partition."""
    base = dt.datetime(2024, 5, 1)
    return [
        {
            "event_id": f"{prefix}{i}",
            "event_time": base + dt.timedelta(hours=7 * i),
            "user_id": f"u{i % 13}",
            "amount": float(i),
            "topic": topic,
            "partition": i % PARTITIONS,
            "offset": first_offset + i // PARTITIONS,
        }
        for i in range(n)
    ]


def batches(rows: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


@pytest.fixture(params=["sqlite", "postgres"])
def catalog_config(request: pytest.FixtureRequest, tmp_path: Path) -> CatalogConfig:
    name = f"t{uuid.uuid4().hex[:12]}"  # one catalog name per test: PostgreSQL's catalog tables are shared
    if request.param == "sqlite":
        return CatalogConfig(
            warehouse=str(tmp_path / "warehouse"), uri=f"sqlite:///{tmp_path / 'catalog.db'}", name=name
        )
    postgres = request.getfixturevalue("postgres")
    return CatalogConfig(warehouse=str(tmp_path / "warehouse"), uri=str(postgres.info["dsn"]), name=name)


@pytest.fixture
def sqlite_config(tmp_path: Path) -> CatalogConfig:
    return CatalogConfig.local(tmp_path)


def committer(config: CatalogConfig, **kwargs: Any) -> IcebergCommitter:
    kwargs.setdefault("partition_by", [("event_time", "day")])
    return IcebergCommitter(open_catalog(config), TABLE, "clicks-sink", **kwargs)


def audit(config: CatalogConfig) -> AuditReport:
    return audit_table(open_catalog(config).load_table(TABLE), id_column="event_id")


def assert_each_once(report: AuditReport, expected: int) -> None:
    assert report.files_referenced_twice == []
    assert report.duplicate_ids == 0, report.duplicate_id_sample
    assert report.distinct_ids == expected
    assert report.rows == expected


_KILLED_WRITER = textwrap.dedent(
    """
    import json, sys, time
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog
    from beamflow.iceberg.committer import IcebergCommitter

    config = CatalogConfig(**json.loads(sys.argv[1]))
    rows = json.loads(sys.stdin.read())
    for row in rows:
        row["event_time"] = __import__("datetime").datetime.fromisoformat(row["event_time"])
    commits = 0

    def before_commit():
        # Files for this batch are written; announce it and wait for the SIGKILL before the catalog commit.
        if commits == 3:
            print("STAGED", flush=True)
            time.sleep(120)

    sink = IcebergCommitter(open_catalog(config), "sink.events", "clicks-sink",
                            partition_by=[("event_time", "day")], before_commit=before_commit)
    for start in range(0, len(rows), 70):
        sink.commit(rows[start:start + 70])
        commits += 1
        print("COMMITTED", commits, flush=True)
    print("FINISHED", flush=True)
    """
)


def test_sigkill_after_files_written_then_rerun_with_other_batches(catalog_config: CatalogConfig) -> None:
    rows = events(400)
    env = {**os.environ, "PYTHONPATH": str(project_root())}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, json.dumps(catalog_config.__dict__)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(rows, default=str))
    proc.stdin.close()
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith(("STAGED", "FINISHED")):
            break
    assert lines[-1] == "STAGED", lines
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stdout.close()

    before = audit(catalog_config)
    assert before.rows == 210  # three committed batches of 70; the fourth was written, never committed
    assert before.orphan_files and before.orphan_files > 0  # the killed batch's files exist but nothing reads them

    # The source never committed its offsets: the rerun replays everything, cut differently.
    sink = committer(catalog_config)
    results = [sink.commit(b) for b in batches(rows, 45)]
    assert sum(r.rows_written for r in results) == 190
    assert sum(r.rows_below_marks for r in results) == 210
    assert_each_once(audit(catalog_config), 400)
    assert sink.committed_marks() == {"clicks": {p: 99 for p in range(PARTITIONS)}}


def test_two_committers_racing_on_the_same_batch(catalog_config: CatalogConfig) -> None:
    first = events(120)
    committer(catalog_config).commit(first[:40])  # the table exists before the race
    barrier = threading.Barrier(2)
    results = []
    errors: list[BaseException] = []

    def race() -> None:
        sink = committer(catalog_config)  # its own catalog handle and connection
        try:
            barrier.wait()
            results.append(sink.commit(first))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=race) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(r.rows_written for r in results) == [0, 80]
    assert_each_once(audit(catalog_config), 120)


def test_expire_to_one_snapshot_then_replay_adds_nothing(catalog_config: CatalogConfig) -> None:
    rows = events(200)
    sink = committer(catalog_config)
    for b in batches(rows, 50):
        sink.commit(b)
    # Compaction makes the head a snapshot without marks; expiring to one leaves only the table property.
    compacted = compact_files(sink.load, small_file_bytes=1 << 30)
    assert compacted.files_removed > compacted.files_added
    expired = expire_snapshots(sink.load, keep_last=1)
    table = sink.load()
    assert len(table.snapshots()) == 1 and len(expired.expired) == 4
    head = table.current_snapshot()
    assert head is not None and head.summary is not None
    assert marks_property("clicks-sink") not in head.summary.additional_properties
    assert read_marks(table, "clicks-sink") == {"clicks": {p: 49 for p in range(PARTITIONS)}}

    replay = [sink.commit(b) for b in batches(rows, 33)]
    assert sum(r.rows_written for r in replay) == 0
    assert len(sink.load().snapshots()) == 1
    assert_each_once(audit(catalog_config), 200)


def test_compaction_while_the_sink_commits(catalog_config: CatalogConfig) -> None:
    rows = events(480)
    sink_errors: list[BaseException] = []

    def run_sink() -> None:
        sink = committer(catalog_config)
        try:
            for b in batches(rows, 30):
                sink.commit(b)
        except BaseException as exc:
            sink_errors.append(exc)

    committer(catalog_config).commit(rows[:30])  # create the table first, so compaction has something to load
    maintenance = committer(catalog_config)
    thread = threading.Thread(target=run_sink)
    thread.start()
    rewritten = 0
    while thread.is_alive():
        rewritten += compact_files(maintenance.load, small_file_bytes=1 << 30).files_removed
        expire_snapshots(maintenance.load, keep_last=5)
    thread.join()
    rewritten += compact_files(maintenance.load, small_file_bytes=1 << 30).files_removed
    assert sink_errors == []
    assert rewritten > 0
    report = audit(catalog_config)
    assert_each_once(report, 480)
    days = len({r["event_time"].date() for r in rows})
    assert report.data_files == days  # after the last compaction: one file per day partition, not one per commit


def one_day(rows: list[dict[str, Any]], newest_first: bool = False) -> list[dict[str, Any]]:
    """``rows`` a minute apart in one day, so each commit writes one file and compaction has one partition; their
    offsets ascend either way (the sink's marks need that)."""
    for i, row in enumerate(rows):
        row["event_time"] = dt.datetime(2024, 5, 1) + dt.timedelta(minutes=len(rows) - 1 - i if newest_first else i)
    return rows


def _stale_first_load(sink: IcebergCommitter, meanwhile: Any) -> Any:
    """A table loader whose first table is stale: ``meanwhile`` commits after it was loaded, as a running sink
    commits while a compaction reads and writes; the compaction's first commit then loses the race."""
    calls = []

    def load() -> Any:
        table = sink.load()
        if not calls:
            meanwhile()
        calls.append(table)
        return table

    return load


def test_compaction_that_lost_to_appends_commits_its_rewrite_without_rereading(sqlite_config: CatalogConfig) -> None:
    """A soak's compaction never committed beside the streaming job: every lost race sent it back to reading and
    writing the day's files, longer than the sinks' second between commits. Appends since its base leave the files
    it replaces live, so the second attempt commits the same rewrite (one read, two attempts)."""
    rows = one_day(events(150))
    sink = committer(sqlite_config)
    for b in batches(rows[:120], 30):
        sink.commit(b)
    result = compact_files(_stale_first_load(sink, lambda: sink.commit(rows[120:])), small_file_bytes=1 << 30)
    assert (result.attempts, result.rewrites, result.files_removed, result.rows_rewritten) == (2, 1, 4, 120)
    report = audit(sqlite_config)
    assert_each_once(report, 150)
    assert report.data_files == 2  # the rewrite's file and the racing append's


def test_compaction_that_lost_to_an_expired_base_checks_the_head_files(sqlite_config: CatalogConfig) -> None:
    """A sink expiring its own snapshots can drop the rewrite's base from the history; the head's manifests then
    show that every replaced file is still live, and the rewrite is committed as it is."""
    rows = one_day(events(150))
    sink = committer(sqlite_config)
    for b in batches(rows[:120], 30):
        sink.commit(b)

    def append_and_expire() -> None:
        sink.commit(rows[120:])
        expire_snapshots(sink.load, keep_last=1)

    result = compact_files(_stale_first_load(sink, append_and_expire), small_file_bytes=1 << 30)
    assert (result.attempts, result.rewrites, result.rows_rewritten) == (2, 1, 120)
    assert_each_once(audit(sqlite_config), 150)


def test_compaction_that_lost_to_another_rewrite_reads_again(sqlite_config: CatalogConfig) -> None:
    """Another compaction since the base removed the files this rewrite replaces: committing it would bring their
    rows back twice, so the second attempt reads the head again."""
    rows = one_day(events(180))
    sink = committer(sqlite_config)
    for b in batches(rows[:120], 30):
        sink.commit(b)

    def compact_then_append() -> None:
        compact_files(sink.load, small_file_bytes=1 << 30)
        sink.commit(rows[120:150])
        sink.commit(rows[150:])

    result = compact_files(_stale_first_load(sink, compact_then_append), small_file_bytes=1 << 30)
    assert (result.attempts, result.rewrites, result.files_removed, result.rows_rewritten) == (2, 2, 3, 180)
    report = audit(sqlite_config)
    assert_each_once(report, 180)
    assert report.data_files == 1


def test_compaction_sorted_by_a_column_writes_its_rows_in_order_in_small_row_groups(tmp_path: Path) -> None:
    """A stream's files each hold a short stretch of event time; a rewrite keeps its inputs' order, so one compacted
    file spans the whole day in every row group unless ``sort_by`` orders it (the sink's key lookup filters by event
    time and prunes by those ranges). Rows arrive newest first here, so the unsorted rewrite is out of order."""
    rows = one_day(events(120), newest_first=True)
    in_order = {}
    for sort_by in (None, "event_time"):
        config = CatalogConfig.local(tmp_path / str(sort_by))
        sink = committer(config)
        for b in batches(rows, 30):
            sink.commit(b)
        result = compact_files(sink.load, small_file_bytes=1 << 30, sort_by=sort_by, row_group_rows=25)
        assert (result.files_removed, result.files_added, result.rows_rewritten) == (4, 1, 120)
        times = sink.load().scan(selected_fields=("event_time",)).to_arrow()["event_time"].to_pylist()
        in_order[sort_by] = times == sorted(times)
        assert_each_once(audit(config), 120)
    assert in_order == {None: False, "event_time": True}
    # The sorted file's row groups (25 rows each) hold disjoint stretches of event time: a scan of one stretch
    # reads one group, where pyiceberg's default (a million rows a group) would read the whole file.
    (task,) = sink.load().scan().plan_files()
    parquet = pq.ParquetFile(task.file.file_path.removeprefix("file://"))
    column = parquet.schema_arrow.get_field_index("event_time")
    stats = [parquet.metadata.row_group(g).column(column).statistics for g in range(parquet.num_row_groups)]
    assert [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)] == [25, 25, 25, 25, 20]
    assert all(a.max < b.min for a, b in itertools.pairwise(stats))


def test_rows_without_coordinates_deduplicated_by_key(sqlite_config: CatalogConfig) -> None:
    def aggregates(windows: range) -> list[dict[str, Any]]:
        return [
            {"event_id": f"w{w}/u{u}", "window": w, "user_id": f"u{u}", "clicks": w * u}
            for w in windows
            for u in range(5)
        ]

    sink = IcebergCommitter(open_catalog(sqlite_config), TABLE, "agg-sink", key_column="event_id")
    assert sink.commit(aggregates(range(0, 6))).rows_written == 30
    second = sink.commit(aggregates(range(3, 9)) + aggregates(range(7, 9)))  # overlap with the table and itself
    assert (second.rows_written, second.rows_existing_key, second.rows_duplicate_in_batch) == (15, 15, 10)
    assert_each_once(audit(sqlite_config), 45)
    with pytest.raises(ValueError, match="no key_column"):
        IcebergCommitter(open_catalog(sqlite_config), TABLE, "agg-sink").commit([{"event_id": "x"}])


def test_schema_evolution_adds_optional_columns_and_refuses_the_rest(sqlite_config: CatalogConfig) -> None:
    sink = committer(sqlite_config)
    sink.commit(events(8))
    newer = [dict(r, offset=r["offset"] + 100, event_id=f"n{i}", campaign="spring") for i, r in enumerate(events(8))]
    assert sink.commit(newer).rows_written == 8
    field = sink.load().schema().find_field("campaign")
    assert not field.required
    older = [dict(r, offset=r["offset"] + 200, event_id=f"o{i}") for i, r in enumerate(events(8))]
    assert sink.commit(older).rows_written == 8  # rows without the new column still append (nulls)
    campaigns = sink.load().scan(selected_fields=("campaign",)).to_arrow()["campaign"]
    assert campaigns.null_count == 16

    changed = [dict(r, offset=r["offset"] + 300, event_id=f"c{i}", amount="lots") for i, r in enumerate(events(8))]
    with pytest.raises(SchemaEvolutionError, match="amount"):
        sink.commit(changed)
    required = pa.Table.from_pylist(
        [dict(r, offset=r["offset"] + 400, event_id=f"r{i}", tier=1) for i, r in enumerate(events(8))]
    )
    schema = required.schema.set(required.schema.get_field_index("tier"), pa.field("tier", pa.int64(), nullable=False))
    with pytest.raises(SchemaEvolutionError, match="required"):
        sink.commit(required.cast(schema))
    assert_each_once(audit(sqlite_config), 24)


def test_beam_transform_replayed_twice_writes_each_row_once(sqlite_config: CatalogConfig) -> None:
    rows = [
        {
            "event_id": f"e{i}",
            "event_time": dt.datetime(2024, 5, 1 + i % 3),
            "amount": float(i),
            "_kafka": {"topic": "clicks", "partition": i % 3, "offset": i // 3},
        }
        for i in range(150)
    ]
    bad = {"event_id": "no-coordinates"}
    clash = {"event_id": "clash", "amount": "not a number", "_kafka": {"topic": "clicks", "partition": 0, "offset": 50}}
    for run in range(2):
        with beam.Pipeline(options=local_options()) as pipeline:
            result = (
                pipeline
                | f"Rows{run}" >> beam.Create(rows + rows + [bad, clash])  # a replay inside the run as well
                | WriteToIceberg(
                    TABLE,
                    sqlite_config,
                    sink_id="beam-sink",
                    max_batch_rows=64,
                    partition_by=[("event_time", "day")],
                )
            )
            written = result.written | beam.Map(lambda c: c["rows_written"]) | beam.CombineGlobally(sum)
            assert_that(written, equal_to([150 if run == 0 else 0]), label="written")
            # The clash shows either while building the batch (ArrowInvalid) or against the table's type.
            reasons = result.dead_letters | beam.Map(
                lambda d: (d.stage, "BadType" if d.error in ("ArrowInvalid", "SchemaEvolutionError") else d.error)
            )
            assert_that(
                reasons,
                equal_to([("WriteToIceberg", "NoCoordinates"), ("WriteToIceberg", "BadType")]),
                label="dead",
            )
    report = audit(sqlite_config)
    assert_each_once(report, 150)
    assert report.property_marks == {"beam-sink": {"clicks": {0: 49, 1: 49, 2: 49}}}


def test_commits_report_beam_metrics(sqlite_config: CatalogConfig) -> None:
    """Each commit reports what it did as Beam metrics (on Flink, per subtask): rows by outcome and the known keys'
    work, so an operator sees a lookup that went back to scanning without reading the workers' logs."""
    from apache_beam.metrics.metric import MetricsFilter

    day = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
    rows = [{"event_id": f"e{i}", "event_time": day + dt.timedelta(seconds=i)} for i in range(30)]
    runs = []
    for run in range(2):  # the second run replays the first: every row found by its key
        pipeline = beam.Pipeline(options=local_options())
        _ = (
            pipeline
            | f"Rows{run}" >> beam.Create(rows + rows[:5])  # five copies within the run as well
            | WriteToIceberg(
                TABLE, sqlite_config, sink_id="metrics-sink", key_column="event_id", key_time_column="event_time"
            )
        )
        result = pipeline.run()
        result.wait_until_finish()
        found = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))
        counters = {m.key.metric.name: m.committed for m in found["counters"]}
        gauges = {m.key.metric.name: m.committed.value for m in found["gauges"]}
        runs.append((counters, gauges))
    (first, _), (second, held) = runs
    assert (first["commits"], first["rows_written"], first["rows_duplicate_in_batch"]) == (1, 30, 5)
    assert (second.get("rows_written", 0), second["rows_existing_key"], second["known_keys_scans"]) == (0, 30, 1)
    assert held["known_keys_held"] == 30
    assert _audit_ids(sqlite_config) == sorted(r["event_id"] for r in rows)


def _audit_ids(config: CatalogConfig) -> list[str]:
    table = open_catalog(config).load_table(TABLE)
    return sorted(table.scan(selected_fields=("event_id",)).to_arrow()["event_id"].to_pylist())
