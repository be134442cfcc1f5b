"""WriteToIceberg on bounded input: grouped once, committed in offset-ordered chunks, nothing lost or doubled.

Runs a real pipeline on the pinned local runner against a local SQLite catalog (no services needed).
"""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from beamflow.iceberg.audit import audit_table
from beamflow.iceberg.catalog import CatalogConfig, open_catalog
from beamflow.iceberg.committer import read_marks
from runners.direct import local_options
from transforms.write_to_iceberg import WriteToIceberg

pytestmark = pytest.mark.unit


def shuffled_events(n: int, partitions: int) -> list[dict[str, Any]]:
    base = dt.datetime(2024, 5, 1)
    rows = [
        {
            "event_id": f"e{i}",
            "event_time": base + dt.timedelta(minutes=i),
            "_kafka": {"topic": "clicks", "partition": i % partitions, "offset": i // partitions},
        }
        for i in range(n)
    ]
    random.Random(3).shuffle(rows)  # arrival order after a shuffle is not offset order
    return rows


def test_bounded_input_commits_every_row_once_in_offset_ordered_chunks(tmp_path: Path) -> None:
    config = CatalogConfig.local(tmp_path)
    rows = shuffled_events(23, partitions=3)
    with beam.Pipeline(options=local_options()) as p:
        result = (
            p | beam.Create(rows) | WriteToIceberg("sink.bounded", config, sink_id="bounded-test", max_batch_rows=5)
        )
        # 23 rows in chunks of 5: five commits, and no wait for the hour-long interval on bounded input.
        assert_that(result.written | beam.Map(lambda c: c["rows_written"]), equal_to([5, 5, 5, 5, 3]))
        assert_that(result.dead_letters, equal_to([]), label="no dead letters")

    table = open_catalog(config).load_table("sink.bounded")
    report = audit_table(table, id_column="event_id")
    assert (report.rows, report.distinct_ids, report.duplicate_ids) == (23, 23, 0)
    assert read_marks(table, "bounded-test") == {"clicks": {0: 7, 1: 7, 2: 6}}


def test_bounded_input_with_key_column_commits_per_bundle_each_key_once(tmp_path: Path) -> None:
    """With ``key_column`` the table's keys decide, not offset order: no grouping, commits as rows arrive.

    Replayed copies (same key) inside the input, out-of-order offsets, batches cut at ``max_batch_rows`` and a whole
    second run over the same input (a restarted backfill) must still leave every key exactly once.
    """
    config = CatalogConfig.local(tmp_path)
    rows = shuffled_events(23, partitions=3)
    with_replays = rows + [dict(r) for r in rows[:7]]
    for run in range(2):
        with beam.Pipeline(options=local_options()) as p:
            result = (
                p
                | beam.Create(with_replays)
                | WriteToIceberg(
                    "sink.keyed",
                    config,
                    sink_id="keyed-test",
                    key_column="event_id",
                    key_time_column="event_time",
                    max_batch_rows=5,
                )
            )
            written = result.written | beam.Map(lambda c: c["rows_written"]) | beam.CombineGlobally(sum)
            assert_that(written, equal_to([23 if run == 0 else 0]), label=f"rows written in run {run}")
            assert_that(result.dead_letters, equal_to([]), label=f"no dead letters in run {run}")
        report = audit_table(open_catalog(config).load_table("sink.keyed"), id_column="event_id")
        assert (report.rows, report.distinct_ids, report.duplicate_ids) == (23, 23, 0)
