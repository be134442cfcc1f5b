"""The Iceberg committer's known keys on a busy hour: this tree's ``KnownKeys`` against another commit's, same run.

    .venv/bin/python -m benchmarks.known_keys [--ids 3000000] [--files 60] [--max-keys 1000000] [--against REV]

The moment measured: a job restarts on the backlog of a busy stream. Its table holds ``--ids`` event ids in one hour of
event time (``--files`` appends, a minute each, as a stream's commits add them; at 1,500 events/s an hour is 5.4
million), and a committer that has not seen the table yet commits batches in that hour, as a job restarted 45 minutes
into it does: minute 45 (not covered yet: a scan), the same minute again (answered from memory), and an early minute
of the hour (a late event).

Each variant runs in a subprocess of its own (this tree's ``beamflow/iceberg/known_keys.py``, and the file at
``--against``, loaded from git in its place), on the same table, read only. Printed per variant: the seconds of each
batch's lookup, the keys held at most, the process's resident memory grown over the run (``VmHWM`` at the end less
``VmRSS`` before the first lookup: Arrow's and Python's memory both), and each batch's answer (rows not in the table),
which must be the same for every variant: the run exits 1 otherwise. Then the ratios of the two variants.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODULE = "beamflow/iceberg/known_keys.py"
HOUR = dt.datetime(2026, 1, 1, 10, tzinfo=dt.UTC)


def _table_dir(work: Path, ids: int, files: int) -> Path:
    return work / f"table-{ids}-{files}"


def build_table(work: Path, ids: int, files: int) -> Path:
    """The busy hour's table (made once per size, then reused): ``ids`` ids over ``files`` appends, a minute each."""
    import pyarrow as pa

    from beamflow.iceberg.catalog import CatalogConfig, open_catalog
    from beamflow.iceberg.committer import ensure_table

    folder = _table_dir(work, ids, files)
    if (folder / "done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    catalog = open_catalog(CatalogConfig.local(folder))
    catalog.create_namespace("kk")
    per_file = ids // files
    table = None
    for minute in range(files):
        first = minute * per_file
        start = HOUR + dt.timedelta(minutes=minute * 60 // files)
        rows = pa.table(
            {
                "event_id": pa.array([f"{i:032x}" for i in range(first, first + per_file)], pa.string()),
                "event_time": pa.array(
                    [start + dt.timedelta(microseconds=i * 50) for i in range(per_file)], pa.timestamp("us", tz="UTC")
                ),
            }
        )
        if table is None:
            table = ensure_table(catalog, "kk.t", rows.schema, [("event_time", "day")], {})
        table.append(rows)
        table = catalog.load_table("kk.t")
    (folder / "done").write_text("")
    return folder


def _batch(replayed_first: int, fresh_first: int, count: int, minute: int) -> Any:
    """``count`` replays of the table's ids from ``replayed_first`` on and ``count`` new ids from ``fresh_first`` on,
    at times in ``minute`` of the hour."""
    import pyarrow as pa

    start = HOUR + dt.timedelta(minutes=minute)
    ids = [*range(replayed_first, replayed_first + count), *range(fresh_first, fresh_first + count)]
    return pa.table(
        {
            "event_id": pa.array([f"{i:032x}" for i in ids], pa.string()),
            "event_time": pa.array(
                [start + dt.timedelta(milliseconds=i % 60_000) for i in ids], pa.timestamp("us", tz="UTC")
            ),
        }
    )


def child(folder: Path, ids: int, files: int, max_keys: int, source: str | None) -> dict[str, Any]:
    """One variant's lookups; ``source``: the known-keys module's text to use instead of this tree's."""
    from beamflow.process_memory import own_peak_rss_mb, proc_rss_mb

    if source is not None:
        module = types.ModuleType("beamflow.iceberg.known_keys")
        module.__file__ = MODULE
        sys.modules[module.__name__] = module
        exec(compile(source, MODULE, "exec"), module.__dict__)
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog
    from beamflow.iceberg.committer import IcebergCommitter
    from beamflow.iceberg.known_keys import KnownKeys

    catalog = open_catalog(CatalogConfig.local(folder))
    committer = IcebergCommitter(catalog, "kk.t", "kk-bench", key_column="event_id", key_time_column="event_time")
    keys = KnownKeys("event_id", "event_time", committer._scan_columns, max_keys=max_keys)
    table = catalog.load_table("kk.t")
    base = table.current_snapshot()
    assert base is not None
    per_file = ids // files  # file k holds ids k * per_file on, in minute k * 60 // files of the hour
    half = per_file // 2
    early = 2 * files // 60  # the first file of minute 2
    restart = 45 * files // 60  # the first file of minute 45
    batches = [  # (what, batch): half replays of one file's ids, half ids the table does not hold
        ("minute 45, not covered", _batch(restart * per_file, ids, half, 45)),
        ("minute 45 again", _batch(restart * per_file, ids, half, 45)),
        ("an early minute", _batch(early * per_file, ids + half, half, 2)),
    ]
    most = 0
    trim = keys._trim

    def counted_trim(needed: Any) -> None:  # both variants trim each batch: what they held just before is the peak
        nonlocal most
        most = max(most, len(keys))
        trim(needed)

    setattr(keys, "_trim", counted_trim)  # noqa: B010 (an instance attribute over the method, for this run only)
    rss_before = proc_rss_mb() or 0.0
    results = []
    for what, batch in batches:
        started = time.perf_counter()
        new = keys.new_rows(table, base, batch)
        seconds = time.perf_counter() - started
        most = max(most, len(keys))
        results.append({"batch": what, "rows": batch.num_rows, "new": new.num_rows, "seconds": round(seconds, 3)})
    stats = keys.stats
    return {
        "batches": results,
        "keys_held_most": max(most, getattr(stats, "peak_keys", 0)),
        "scans": stats.scans,
        "rss_growth_mb": round(own_peak_rss_mb() - rss_before, 1),
    }


def _variant(folder: Path, args: argparse.Namespace, against: str | None) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.known_keys", "--child", str(folder)]
    command += ["--ids", str(args.ids), "--files", str(args.files), "--max-keys", str(args.max_keys)]
    if against:
        command += ["--source-rev", against]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"variant {against or 'this tree'} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.known_keys", description=__doc__.split("\n")[0])
    parser.add_argument("--ids", type=int, default=3_000_000)
    parser.add_argument("--files", type=int, default=60)
    parser.add_argument("--max-keys", type=int, default=1_000_000)
    parser.add_argument("--against", default="78f03ee", help="the commit whose known_keys.py is the baseline")
    parser.add_argument("--work", default=str(ROOT / ".data" / "bench-known-keys"))
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--source-rev", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        source = None
        if args.source_rev:
            source = subprocess.run(
                ["git", "show", f"{args.source_rev}:{MODULE}"], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout
        print(json.dumps(child(Path(args.child), args.ids, args.files, args.max_keys, source)))
        return 0

    started = time.monotonic()
    folder = build_table(Path(args.work), args.ids, args.files)
    print(f"table: {args.ids:,} ids in {args.files} appends over one hour ({time.monotonic() - started:.0f} s)")
    variants = {f"known_keys.py at {args.against}": args.against, "this tree": None}
    out = {name: _variant(folder, args, rev) for name, rev in variants.items()}
    for name, result in out.items():
        print(
            f"{name}: keys held at most {result['keys_held_most']:,}, scans {result['scans']}, "
            f"resident memory grown {result['rss_growth_mb']:,.0f} MB"
        )
        for b in result["batches"]:
            print(f"  {b['batch']:26} {b['rows']:,} rows, {b['new']:,} new, {b['seconds']:.2f} s")
    (old, new) = out.values()
    answers = [[b["new"] for b in r["batches"]] for r in out.values()]
    ratio = old["rss_growth_mb"] / new["rss_growth_mb"] if new["rss_growth_mb"] else float("inf")
    print(f"memory grown, {next(iter(variants))} / this tree: {ratio:.2f}x")
    for i, (b_old, b_new) in enumerate(zip(old["batches"], new["batches"], strict=True)):
        ratio = b_new["seconds"] / b_old["seconds"] if b_old["seconds"] else float("inf")
        print(f"seconds, batch {i + 1} ({b_new['batch']}), this tree / baseline: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "variants": out}, indent=2))
    if answers[0] != answers[1]:
        print(f"ANSWERS DIFFER: {answers}")
        return 1
    print(f"answers (rows new per batch) identical: {answers[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
