"""Iceberg sink cost, as ratios against bare pyiceberg measured in the same run (local SQLite catalog).

1. Throughput: the exactly-once committer (mark read, filter, dedup, append + marks in one transaction)
   against bare ``table.append`` of the same Arrow rows: one bare append of everything (the brief's baseline;
   goal >= 0.5x) and bare appends with the same batch boundaries (the protocol's own overhead).
2. Commit latency as history grows: commit time at snapshot 10, 100 and 500 with the sink's maintenance on
   (expire every ``--expire-every`` commits keeping ``--keep`` snapshots, compact every ``--compact-every``);
   goal: snapshot 500 within 2x of snapshot 10. ``--no-maintenance`` shows the same curve without it.
3. Keyed commits (``key_column``, as the clicks job commits event ids after its shuffle), two committers taking
   turns as two subtasks do, each batch's event times spread over a backlog's whole range: ``followed`` (the keys
   scanned once, then followed through the appended files, ``beamflow.iceberg.known_keys``) against ``scanned``
   (the key column of the batch's time range scanned before every commit, the committer's earlier behaviour), commit
   time at commit 10, 100 and ``--keyed-commits``; ratio scanned / followed at the last. Audited: every event id once.

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
from beamflow.iceberg.known_keys import KnownKeys
from beamflow.iceberg.maintenance import compact_files, expire_snapshots


def make_rows(n: int, first_offset: int = 0, partitions: int = 8, spread_s: int | None = None) -> pa.Table:
    """n click events with 10 columns, coordinates round-robin over ``partitions`` partitions; with ``spread_s`` the
    event times are scattered over that many seconds (a backlog's batches each span its whole range)."""
    base = dt.datetime(2024, 5, 1)
    idx = range(first_offset, first_offset + n)
    seconds = [i if spread_s is None else (i * 7919) % spread_s for i in idx]
    return pa.table(
        {
            "event_id": [f"e{i}" for i in idx],
            "event_time": [base + dt.timedelta(seconds=x) for x in seconds],
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


class _ScannedEveryCommit(KnownKeys):
    """The committer's earlier behaviour: the batch's time range scanned before every commit."""

    def new_rows(self, table: Any, base: Any, batch: pa.Table) -> pa.Table:
        self.reset()
        return super().new_rows(table, base, batch)


def keyed_commits(root: Path, commits: int, rows_per_commit: int, keep: int, expire_every: int) -> dict[str, Any]:
    """Two committers taking turns on one keyed table, per variant; commit times and an audit of the event ids."""
    spread_s = 2 * 86_400  # two days of event time, as a backlog after an outage
    out: dict[str, Any] = {"commits": commits, "rows_per_commit": rows_per_commit}
    for variant in ("scanned", "followed"):
        catalog = open_catalog(CatalogConfig.local(root / f"keyed-{variant}"))
        pair = [
            IcebergCommitter(
                catalog,
                "bench.keyed",
                "bench-keyed",
                key_column="event_id",
                key_time_column="event_time",
                partition_by=[("event_time", "day")],
            )
            for _ in range(2)
        ]
        if variant == "scanned":
            for committer in pair:
                committer.known_keys = _ScannedEveryCommit("event_id", "event_time", committer._scan_keys)
        times: list[float] = []
        for n in range(commits):
            batch = make_rows(rows_per_commit, first_offset=n * rows_per_commit, spread_s=spread_s)
            committer = pair[n % 2]
            t0 = time.perf_counter()
            written = committer.commit(batch).rows_written
            times.append(time.perf_counter() - t0)
            assert written == rows_per_commit, f"{variant}: commit {n} wrote {written} of {rows_per_commit}"
            if (n + 1) % expire_every == 0:
                expire_snapshots(committer.load, keep_last=keep)
        ids = pair[0].load().scan(selected_fields=("event_id",)).to_arrow()["event_id"].to_pylist()
        assert len(ids) == len(set(ids)) == commits * rows_per_commit, f"{variant}: audit failed"
        points = [k for k in (10, 100, commits) if k <= commits]
        out[variant] = {
            "commit_ms_at": {k: round(statistics.median(times[max(0, k - 9) : k]) * 1000, 1) for k in points},
            "total_s": round(sum(times), 2),
            "scans": sum(c.known_keys.stats.scans for c in pair if c.known_keys is not None),
            "files_read": sum(c.known_keys.stats.files_read for c in pair if c.known_keys is not None),
        }
    last = commits
    out["scanned_vs_followed_at_last_commit"] = round(
        out["scanned"]["commit_ms_at"][last] / out["followed"]["commit_ms_at"][last], 2
    )
    out["scanned_vs_followed_total"] = round(out["scanned"]["total_s"] / out["followed"]["total_s"], 2)
    return out


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
    parser.add_argument("--keyed-commits", type=int, default=400, help="commits per variant in section 3")
    parser.add_argument("--keyed-only", action="store_true", help="run section 3 only")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="beamflow-iceberg-bench-"))
    try:
        report: dict[str, Any] = {"keyed_commits": keyed_commits(root, args.keyed_commits, 500, 50, args.expire_every)}
        if args.keyed_only:
            print(json.dumps(report, indent=2))
            return
        report["throughput"] = throughput(root, args.rows, args.batch)
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
