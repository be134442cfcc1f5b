"""Iceberg sink cost, as ratios against bare pyiceberg measured in the same run (local SQLite catalog).

1. Throughput: the exactly-once committer (mark read, filter, dedup, append + marks in one transaction)
   against bare ``table.append`` of the same Arrow rows: one bare append of everything (the brief's baseline;
   goal >= 0.5x) and bare appends with the same batch boundaries (the protocol's own overhead).
2. Commit latency as history grows: commit time at snapshot 10, 100 and 500 with the sink's maintenance on
   (expire every ``--expire-every`` commits keeping ``--keep`` snapshots, compact every ``--compact-every``);
   goal: snapshot 500 within 2x of snapshot 10. ``--no-maintenance`` shows the same curve without it.

Run: ``.venv/bin/python benchmarks/iceberg_sink.py [--rows 200000 --batch 20000 --commits 500]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from beamflow.iceberg.catalog import CatalogConfig, open_catalog
from beamflow.iceberg.committer import IcebergCommitter, ensure_table
from beamflow.iceberg.maintenance import compact_files, expire_snapshots


def make_rows(n: int, first_offset: int = 0, partitions: int = 8) -> pa.Table:
    """n click events with 10 columns, coordinates round-robin over ``partitions`` partitions."""
    base = dt.datetime(2024, 5, 1)
    idx = range(first_offset, first_offset + n)
    return pa.table(
        {
            "event_id": [f"e{i}" for i in idx],
            "event_time": [base + dt.timedelta(seconds=i) for i in idx],
            "user_id": [f"u{i % 9973}" for i in idx],
            "campaign": [f"c{i % 17}" for i in idx],
            "amount": [float(i % 1000) / 10 for i in idx],
            "clicks": [i % 5 for i in idx],
            "country": [("DE", "FR", "US", "BR")[i % 4] for i in idx],
            "topic": ["clicks"] * n,
            "partition": pa.array([i % partitions for i in idx], pa.int32()),
            "offset": pa.array([i // partitions for i in idx], pa.int64()),
        }
    )


def throughput(root: Path, rows: int, batch: int) -> dict[str, Any]:
    data = make_rows(rows)
    batches = [data.slice(i, batch) for i in range(0, rows, batch)]
    catalog = open_catalog(CatalogConfig.local(root / "throughput"))
    warm = ensure_table(catalog, "bench.warmup", data.schema)  # first-use costs (imports, caches) off the clock
    warm.append(_conform(data.slice(0, 1000), warm))

    bare = ensure_table(catalog, "bench.bare_one", data.schema)
    t0 = time.perf_counter()
    bare.append(bare.schema().as_arrow().empty_table() if rows == 0 else _conform(data, bare))
    bare_one_s = time.perf_counter() - t0

    bare_b = ensure_table(catalog, "bench.bare_batches", data.schema)
    t0 = time.perf_counter()
    for b in batches:
        bare_b.append(_conform(b, bare_b))
    bare_batches_s = time.perf_counter() - t0

    sink = IcebergCommitter(catalog, "bench.sink", "bench-sink")
    sink.commit(data.slice(0, 1))  # create the table outside the timing (the bare tables were made above too)
    t0 = time.perf_counter()
    for b in batches:
        sink.commit(b)
    sink_s = time.perf_counter() - t0
    replay_t0 = time.perf_counter()
    replayed = sum(sink.commit(b).rows_written for b in batches)  # a full replay: all filtered, nothing written
    replay_s = time.perf_counter() - replay_t0
    assert replayed == 0
    return {
        "rows": rows,
        "batch": batch,
        "bare_one_append_rows_per_s": rows / bare_one_s,
        "bare_batched_appends_rows_per_s": rows / bare_batches_s,
        "sink_rows_per_s": rows / sink_s,
        "sink_vs_one_bare_append": bare_one_s / sink_s,
        "sink_vs_same_batches_bare": bare_batches_s / sink_s,
        "replay_rows_per_s": rows / replay_s,
    }


def _conform(batch: pa.Table, table: Any) -> pa.Table:
    return batch.cast(table.schema().as_arrow())


def commit_latency(
    root: Path,
    commits: int,
    rows_per_commit: int,
    maintenance: bool,
    keep: int,
    expire_every: int,
    compact_every: int,
) -> dict[str, Any]:
    catalog = open_catalog(CatalogConfig.local(root / ("latency" if maintenance else "latency-nomaint")))
    sink = IcebergCommitter(catalog, "bench.latency", "bench-sink")
    times: list[float] = []
    maint_s = 0.0
    for n in range(commits):
        b = make_rows(rows_per_commit, first_offset=n * rows_per_commit)
        t0 = time.perf_counter()
        sink.commit(b)
        times.append(time.perf_counter() - t0)
        if maintenance:
            t1 = time.perf_counter()
            if (n + 1) % expire_every == 0:
                expire_snapshots(sink.load, keep_last=keep)
            if (n + 1) % compact_every == 0:
                compact_files(sink.load, small_file_bytes=64 * 1024 * 1024)
            maint_s += time.perf_counter() - t1

    def around(
        k: int,
    ) -> float:  # median of the 9 commits ending at snapshot k, in ms (the machine is shared)
        window = times[max(1, k - 9) : k]
        return statistics.median(window) * 1000 if window else float("nan")

    table = sink.load()
    points = [k for k in (10, 100, 500) if k <= commits]
    result: dict[str, Any] = {
        "maintenance": maintenance,
        "commits": commits,
        "commit_ms_at": {k: round(around(k), 1) for k in points},
        "snapshots_left": len(table.snapshots()),
        "maintenance_total_s": round(maint_s, 2),
    }
    if points:
        result["last_vs_10"] = round(around(points[-1]) / around(10), 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--commits", type=int, default=500)
    parser.add_argument("--rows-per-commit", type=int, default=200)
    parser.add_argument("--keep", type=int, default=10)
    parser.add_argument("--expire-every", type=int, default=10)
    parser.add_argument("--compact-every", type=int, default=50)
    parser.add_argument("--no-maintenance", action="store_true", help="also measure the curve without maintenance")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="beamflow-iceberg-bench-"))
    try:
        report: dict[str, Any] = {"throughput": throughput(root, args.rows, args.batch)}
        report["latency_with_maintenance"] = commit_latency(
            root, args.commits, args.rows_per_commit, True, args.keep, args.expire_every, args.compact_every
        )
        if args.no_maintenance:
            report["latency_without_maintenance"] = commit_latency(
                root,
                args.commits,
                args.rows_per_commit,
                False,
                args.keep,
                args.expire_every,
                args.compact_every,
            )
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
