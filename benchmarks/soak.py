"""Soak of the streaming clicks job on Flink (issue 15, item 4): memory and checkpoint size under steady traffic.

    BEAMFLOW_DATA=$PWD/.data/soak .venv/bin/python -m benchmarks.soak [--minutes 10] [--rate 100] \
        [--sample-s 30] [--checkpoint-ms 10000] [--restart-down-s 0] [--json F]
    BEAMFLOW_DATA=$PWD/.data/soak .venv/bin/python -m benchmarks.soak --resume <the soak's conf> \
        --restart-down-s 120 --rate 1500 [--json F]

``--restart-down-s S`` ends the soak as an upgrade does: the job stopped with a savepoint, S seconds of live traffic
piling up, the job restored from the savepoint by fresh Python workers, sampled every 5 s until the lag is under two
checkpoint intervals of traffic, then 60 s more (``restore_and_catch_up``). ``--resume`` does only that, for the job
of an earlier soak (its conf is written beside its savepoints, under the warehouse's ``soak`` folder), from the
newest savepoint there.

On demand, not in the test run. The job is ``pipelines.clicks`` in the production shape (parallelism 2 over two
TaskManagers with their Python SDK workers, ``conf/flink.yaml``'s settings, checkpoints every ``--checkpoint-ms``),
fed live traffic at ``--rate`` records/s (``benchmarks.flink_streaming.LiveProducer``: event time = now, 5% duplicate
sends, bad records). Every ``--sample-s`` seconds: the resident memory (VmRSS) of each TaskManager JVM and of the job's
Python SDK workers (summed), the latest completed checkpoint's full state size and its incremental size (Flink
REST), and the consumer lag. Prints the curve and the growth between minute 2 and the last sample (goal: under 10%
for TaskManager RSS, Python worker RSS and checkpoint size; what grows without bound is what matters: the read's
SDF restriction state on portable Flink, apache/beam#27648). And the Python workers' CPU seconds a minute, the same
goal: the input rate is constant, so the work a minute must be too. An 80-minute soak found it doubling (9.5 -> 20.3
s a minute per worker) while memory and checkpoints looked fine: the Iceberg committer rescanned late events'
minutes, each scan reading more files as the run went on (``docs/streaming.md``, "Late events sent the known keys
back to a scan").

``--compact-every-min M`` runs the table maintenance a user schedules beside the job (``beamflow iceberg compact``;
``--compact-sort-by`` and ``--compact-row-group-rows`` are its ``--sort-by`` and ``--row-group-rows``) every M
minutes from the soak's own process, and reports each run: files rewritten, seconds, attempts lost to the sink's
commits. Without it the table's file count grows all day, and so does what each of the sink's key lookups plans
over.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

GOAL_GROWTH = 0.10
# Where a TaskManager's resident memory goes, summed over the TaskManagers (Flink's JVM metrics): the heap in use
# (sawtooth between collections), its committed size (what the JVM took from the OS), and RocksDB's managed memory.
JVM_METRICS = {
    "Status.JVM.Memory.Heap.Used": "tm_heap_used_mb",
    "Status.JVM.Memory.Heap.Committed": "tm_heap_committed_mb",
    "Status.JVM.Memory.NonHeap.Used": "tm_nonheap_used_mb",
    "Status.Flink.Memory.Managed.Used": "tm_managed_used_mb",
}
SERIES = ("taskmanager_rss_mb", "python_workers_rss_mb", "checkpoint_state_mb", "checkpoint_incremental_mb")


def rss_mb(pid: int) -> float:
    """Resident memory of one process in MB (0 when it is gone)."""
    from beamflow.process_memory import proc_rss_mb

    return proc_rss_mb(pid) or 0.0


def work_growth(samples: list[dict[str, Any]], from_s: float, span: int = 5) -> tuple[float, float, float] | None:
    """The Python workers' CPU seconds a minute over the first ``span`` sample intervals of the run's second half (or
    from ``from_s``, if later) and over the last ``span``, and the relative growth between them. The second half:
    the work a minute steps up once the committers' known keys fill their bound (about 11 minutes at 1,500 events/s)
    and the late events' minutes start coming back as scans; a step is not growth, a slope is. Intervals in which the
    workers changed (a restart resets their counts) are left out."""
    if not samples:
        return None
    start = max(from_s, samples[-1]["t_s"] / 2)
    rates = [
        (b["python_workers_cpu_s"] - a["python_workers_cpu_s"]) * 60 / (b["t_s"] - a["t_s"])
        for a, b in itertools.pairwise(samples)
        if a["t_s"] >= start
        and a.get("python_workers_pids") == b.get("python_workers_pids")
        and b["python_workers_cpu_s"] >= a["python_workers_cpu_s"]
        and b["t_s"] > a["t_s"]
    ]
    if len(rates) < 2 * span:
        return None
    first, last = sum(rates[:span]) / span, sum(rates[-span:]) / span
    return first, last, (last - first) / first if first else float("nan")


def heap_resident_mb(pid: int) -> float:
    """How much of a JVM's heap reservation is resident: the Rss of its mapping sized like ``-Xmx``.

    The TaskManagers start with ``-Xms`` = ``-Xmx``: the heap is committed at once but its pages become resident only
    as G1 first touches them, so RSS can climb towards the heap size with no leak at all. RSS minus this is the
    memory outside the heap (metaspace, code, threads, direct buffers, RocksDB's native memory)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        xmx = next(int(a[4:]) for a in argv if a.startswith(b"-Xmx") and a[4:].isdigit())
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except (OSError, StopIteration):
        return 0.0
    for i, line in enumerate(lines):
        # G1 aligns the reservation to its region size: within a few percent of -Xmx, and nothing else is that big.
        if line.startswith("Size:") and abs(int(line.split()[1]) * 1024 - xmx) < 0.05 * xmx:
            rss = next((x for x in lines[i + 1 : i + 6] if x.startswith("Rss:")), None)
            return int(rss.split()[1]) / 1024 if rss else 0.0
    return 0.0


def sample(rest: Any, job_id: str, flink: Any, job_name: str, config: dict[str, Any], t0: float) -> dict[str, Any]:
    from beamflow.cli.status import kafka_lag
    from beamflow.services.flink import python_workers
    from benchmarks.flink_streaming import _proc_table

    taskmanagers = [pid for role, pid in flink.info["roles"].items() if role.startswith("taskmanager")]
    workers = python_workers(flink, job_name)
    checkpoints = rest.checkpoints(job_id)
    latest = (checkpoints.get("latest") or {}).get("completed") or {}
    counts = checkpoints.get("counts") or {}
    try:
        lag = sum(kafka_lag(config).values())
    except Exception:
        lag = -1
    jvm: dict[str, float] = {}
    for tm in rest.taskmanagers():
        try:
            for name, value in rest.taskmanager_metrics(tm["id"], list(JVM_METRICS)).items():
                jvm[name] = jvm.get(name, 0.0) + value
        except Exception:  # a missed sample is fine
            pass
    tm_rss = sum(rss_mb(p) for p in taskmanagers)
    processes = _proc_table()  # user + sys CPU seconds per pid (a worker gone since the listing counts nothing)
    return {
        "t_s": round(time.monotonic() - t0),
        "taskmanager_rss_mb": round(tm_rss, 1),
        "tm_rss_outside_heap_mb": round(tm_rss - sum(heap_resident_mb(p) for p in taskmanagers), 1),
        **{key: round(jvm[name] / 2**20, 1) if name in jvm else None for name, key in JVM_METRICS.items()},
        "python_workers": len(workers),
        "python_workers_rss_mb": round(sum(rss_mb(p) for p in workers), 1),
        "python_workers_cpu_s": round(sum(processes[p][1] for p in workers if p in processes), 2),
        "python_workers_pids": sorted(workers),
        "checkpoint_id": latest.get("id"),
        "checkpoint_state_mb": round(float(latest.get("state_size") or 0) / 2**20, 3),
        "checkpoint_incremental_mb": round(float(latest.get("checkpointed_size") or 0) / 2**20, 3),
        "checkpoint_duration_s": round(float(latest.get("end_to_end_duration") or 0) / 1000, 1),
        "checkpoints_completed": counts.get("completed"),
        "checkpoints_failed": counts.get("failed"),
        "load_1m": round(os.getloadavg()[0], 1),
        "lag": lag,
    }


def sample_running(rest: Any, job_id: str, flink: Any, config: dict[str, Any], t0: float) -> dict[str, Any]:
    """``sample`` of a job that must still run: a soak stops at the first failure rather than sample a dead job."""
    state = rest.job_state(job_id)
    if state != "RUNNING":
        raise RuntimeError(f"the job is {state}: {rest.job_exceptions(job_id)}")
    return sample(rest, job_id, flink, config["flink"]["job_name"], config, t0)


class CompactionSchedule(threading.Thread):
    """``compact_files`` on the soak's Iceberg table every ``every_s`` seconds, beside the running job, as a user's
    scheduled ``beamflow iceberg compact`` would; each run's result is kept for the report."""

    def __init__(
        self, config: dict[str, Any], every_s: float, sort_by: str | None, row_group_rows: int | None, t0: float
    ) -> None:
        super().__init__(name="soak-compaction", daemon=True)
        self.config, self.every_s, self.t0 = config, every_s, t0
        self.sort_by, self.row_group_rows = sort_by, row_group_rows
        self.runs: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        from beamflow.iceberg.catalog import CatalogConfig, open_catalog
        from beamflow.iceberg.maintenance import compact_files

        iceberg = self.config["iceberg"]
        catalog = open_catalog(CatalogConfig(**iceberg["catalog"]))
        while not self._stop_event.wait(self.every_s):
            started = time.monotonic()
            try:
                result = compact_files(
                    lambda: catalog.load_table(iceberg["table"]),
                    sort_by=self.sort_by,
                    row_group_rows=self.row_group_rows,
                )
            except BaseException as exc:  # reported at the end; the soak's job goes on without maintenance
                self.error = exc
                return
            self.runs.append(
                {
                    "t_s": round(started - self.t0),
                    "seconds": round(time.monotonic() - started, 1),
                    **{k: v for k, v in result.__dict__.items() if k != "snapshot_id"},
                }
            )
            print(json.dumps({"compaction": self.runs[-1]}), flush=True)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=600)

    def report(self) -> list[str]:
        runs = self.runs
        longest = max((r["seconds"] for r in runs), default=0)
        line = (
            f"compactions every {self.every_s / 60:g} min (sorted by {self.sort_by or 'nothing'}, row groups of "
            f"{self.row_group_rows or 'the table default'} rows): {len(runs)}, "
            f"{sum(r['files_removed'] for r in runs):,} files rewritten into {sum(r['files_added'] for r in runs):,}, "
            f"{sum(r['seconds'] for r in runs):.0f} s in all, longest {longest:g} s, "
            f"attempts {sum(r['attempts'] for r in runs)}"
        )
        return [line] + ([f"compaction FAILED and stopped: {self.error!r}"] if self.error else [])


def savepoint_mb(rest: Any, job_id: str, target: Path) -> float:
    """Takes a savepoint (Flink's canonical format: live state only, no RocksDB files) and returns its size in MB.

    A RocksDB checkpoint's size also counts what compaction has not yet dropped (overwritten and removed entries, in
    files the incremental checkpoints keep sharing), so it can grow while the live state does not; the savepoint
    tells the two apart."""
    location = rest.wait_for_savepoint(job_id, rest.trigger_savepoint(job_id, str(target)), timeout=180)
    folder = Path(location.removeprefix("file:"))
    return round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20, 3)


def growth(samples: list[dict[str, Any]], key: str, from_s: float) -> float | None:
    """Relative growth of ``key`` from the first sample at or after ``from_s`` to the last sample."""
    base = next((s for s in samples if s["t_s"] >= from_s), None)
    if base is None or not base[key] or base is samples[-1]:
        return None
    return float((samples[-1][key] - base[key]) / base[key])


def report(samples: list[dict[str, Any]], from_s: float) -> list[str]:
    header = f"{'t (s)':>6} {'TM RSS MB':>10} {'heap used':>9} {'heap comm':>9} {'non-heap':>8} {'managed':>7} " + (
        f"{'workers':>7} {'worker RSS MB':>13} {'ckpt':>5} {'ckpt s':>6} {'state MB':>9} {'incr MB':>8} {'lag':>6}"
    )
    lines = [header]

    def mb(value: float | None, width: int) -> str:
        return f"{value:>{width}.1f}" if value is not None else f"{'-':>{width}}"

    for s in samples:
        lines.append(
            f"{s['t_s']:>6} {s['taskmanager_rss_mb']:>10.1f} {mb(s.get('tm_heap_used_mb'), 9)} "
            f"{mb(s.get('tm_heap_committed_mb'), 9)} {mb(s.get('tm_nonheap_used_mb'), 8)} "
            f"{mb(s.get('tm_managed_used_mb'), 7)} {s['python_workers']:>7} "
            f"{s['python_workers_rss_mb']:>13.1f} {s['checkpoint_id'] or '-':>5} "
            f"{s.get('checkpoint_duration_s', 0):>6.1f} {s['checkpoint_state_mb']:>9.3f} "
            f"{s['checkpoint_incremental_mb']:>8.3f} {s['lag']:>6}"
        )
    lines.append(f"growth from minute {from_s / 60:g} to the last sample (goal < {GOAL_GROWTH:.0%}):")
    for key in SERIES:
        value = growth(samples, key, from_s)
        verdict = "n/a" if value is None else f"{value:+.1%} ({'met' if value < GOAL_GROWTH else 'MISSED'})"
        lines.append(f"  {key:28} {verdict}")
    work = work_growth(samples, from_s)
    if work is None:
        lines.append("  python workers' CPU s a minute  n/a (too few samples)")
    else:
        first, last, change = work
        verdict = f"{change:+.1%} ({'met' if change < GOAL_GROWTH else 'MISSED'})"
        lines.append(f"  python workers' CPU s a minute  {first:.1f} -> {last:.1f} over the second half: {verdict}")
    lines.append(
        "where the TaskManagers' memory went over the same stretch (no goal; heap used is a sawtooth; RSS outside "
        "the heap excludes heap pages G1 touches for the first time, bounded by -Xmx):"
    )
    for key in ("tm_rss_outside_heap_mb", "tm_heap_committed_mb", "tm_nonheap_used_mb", "tm_managed_used_mb"):
        value = growth([s for s in samples if s.get(key) is not None], key, from_s)
        lines.append(f"  {key:28} {'n/a' if value is None else f'{value:+.1%}'}")
    return lines


def restore_and_catch_up(
    rest: Any, config: dict[str, Any], workdir: Path, flink: Any, savepoint: str, down_s: float, rate: float
) -> dict[str, Any]:
    """An upgrade's restart under live traffic: after ``down_s`` of traffic piling up, the job restored from
    ``savepoint`` by fresh Python workers (whose committers know no keys yet: the first commit scans the hour the
    backlog's events fall in, an hour a soak has filled). Sampled every 5 s until the lag is under two checkpoint
    intervals of traffic, then 60 s more: the catch-up's seconds, the Python workers' and TaskManagers' memory at
    most, the checkpoints' durations (the latest completed one at each sample), failures and restarts."""
    from benchmarks.flink_streaming import _submit, collect_checkpoints, slowest_checkpoint_lines

    time.sleep(down_s)
    config["flink"]["savepoint_path"] = savepoint
    job_id, _ = _submit(config, workdir)
    caught_up_lag = int(rate * 2 * config["flink"]["checkpointing_interval_ms"] / 1000)
    t0 = time.monotonic()
    t0_ms = time.time() * 1000
    samples: list[dict[str, Any]] = []
    checkpoints: dict[int, dict[str, Any]] = {}
    caught_up_s: float | None = None
    while time.monotonic() < t0 + 1800:
        samples.append(sample_running(rest, job_id, flink, config, t0))
        with contextlib.suppress(Exception):  # a missed poll loses no checkpoint: Flink keeps the last ten
            collect_checkpoints(rest, job_id, checkpoints)
        print(json.dumps({"restored": True, **samples[-1]}), flush=True)
        lag = samples[-1]["lag"]
        if caught_up_s is None and samples[-1]["checkpoints_completed"] and 0 <= lag <= caught_up_lag:
            caught_up_s = samples[-1]["t_s"]
        if caught_up_s is not None and samples[-1]["t_s"] >= caught_up_s + 60:
            break
        time.sleep(5)
    counts = rest.checkpoints(job_id).get("counts", {})
    names = {v["id"]: v.get("name", "") for v in rest.job(job_id).get("vertices", [])}
    ordered = sorted(checkpoints.values(), key=lambda c: c["id"])
    report = [
        f"restored from {savepoint} after {down_s:g} s down:",
        f"  lag at most {max(s['lag'] for s in samples):,} records; under two intervals of traffic ({caught_up_lag:,}) "
        + (f"after {caught_up_s:.0f} s" if caught_up_s is not None else "NEVER in 30 minutes"),
        f"  Python workers at most {max(s['python_workers_rss_mb'] for s in samples):,.0f} MB, TaskManagers at most "
        f"{max(s['taskmanager_rss_mb'] for s in samples):,.0f} MB",
        f"  checkpoints completed {counts.get('completed')}, failed {counts.get('failed')}; the longest seen "
        f"{max(s['checkpoint_duration_s'] for s in samples):.1f} s; restarts {len(rest.failure_history(job_id))}",
        "  checkpoints after the submission (triggered at s: status, s): "
        + ", ".join(
            f"#{c['id']} {(c['trigger_ms'] - t0_ms) / 1000:.0f}: {c['status'].lower()} "
            f"{(c['duration_ms'] or 0) / 1000:.1f}"
            for c in ordered
            if c["trigger_ms"]
        ),
        "  slowest checkpoints' parts (max over subtasks, per vertex; ms):",
        *slowest_checkpoint_lines(ordered, names),
    ]
    return {
        "job_id": job_id,
        "samples": samples,
        "checkpoints": ordered,
        "caught_up_s": caught_up_s,
        "report": report,
    }


def newest_savepoint(workdir: Path) -> str:
    """The newest savepoint a soak took in ``workdir`` (each soak ends with one)."""
    found = sorted((workdir / "savepoints").glob("savepoint-*"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no savepoint under {workdir / 'savepoints'}")
    return f"file://{found[-1].resolve()}"


def _second_taskmanager_env(extra: dict[str, str]) -> None:
    """Makes the local cluster start its second TaskManager with ``extra`` in its environment (inherited by its Python
    workers); refuses a cluster already up, which would run without it. ``extra`` wins over the cluster's own
    settings too: ``PYTHONPATH=<another checkout>`` runs that tree's code in the second TaskManager's workers (their
    working directory is the cluster's, so the checkout comes before the installed project), an A/B of a code change."""
    import functools
    from unittest import mock

    from beamflow.services import ServiceSet
    from beamflow.services.flink import FlinkService

    if ServiceSet().get("flink").status().get("running"):
        raise SystemExit("--second-tm-env needs the cluster down first: beamflow services down flink")
    start = FlinkService._start_taskmanager

    @functools.wraps(start)
    def start_with_env(self: FlinkService, ports: dict[str, int], index: int = 1) -> int:
        if index != 2:
            return start(self, ports, index)
        own_env = self._env
        with (
            mock.patch.dict(os.environ, extra),  # start_process copies os.environ into the child's
            mock.patch.object(self, "_env", lambda: {**own_env(), **extra}),  # ... then the cluster's over it
        ):
            return start(self, ports, index)

    FlinkService._start_taskmanager = start_with_env  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=100.0, help="live records per second")
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--checkpoint-ms", type=int, default=10_000)
    parser.add_argument("--from-minute", type=float, default=2.0, help="growth is measured from this minute on")
    parser.add_argument("--json", help="write the samples here")
    parser.add_argument(
        "--restart-down-s",
        type=float,
        default=0.0,
        help="then stop with a savepoint, let live traffic pile up this long, restore it, measure the catch-up",
    )
    parser.add_argument(
        "--resume",
        metavar="CONF",
        help="no soak: restore the job of an earlier soak (its conf, written beside its savepoints) from its newest "
        "savepoint after --restart-down-s of live traffic",
    )
    parser.add_argument(
        "--compact-every-min",
        type=float,
        default=0.0,
        help="compact the Iceberg table this often beside the job (0: never, the table's files pile up)",
    )
    parser.add_argument("--compact-sort-by", help="the compaction's --sort-by column (e.g. event_time)")
    parser.add_argument("--compact-row-group-rows", type=int, help="the compaction's --row-group-rows")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="run benchmarks.soak_probe (tracemalloc and object counts in each Python worker, /tmp/beamflow-probe)",
    )
    parser.add_argument(
        "--second-tm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="start the cluster's second TaskManager (and so its Python workers) with this environment variable: an "
        "A/B inside one run (e.g. MALLOC_ARENA_MAX=2, or PYTHONPATH=<a checkout of another commit>); the cluster must "
        "not be running yet",
    )
    args = parser.parse_args(argv)
    if args.second_tm_env:
        _second_taskmanager_env(dict(item.split("=", 1) for item in args.second_tm_env))

    from beamflow.flink_rest import FlinkRest
    from beamflow.kafka.admin import create_topic
    from benchmarks.flink_streaming import LiveProducer, _services, _submit, _variant_config

    states = _services()
    if args.resume:
        return resume(args, states)
    config = _variant_config("soak", states, 2)
    config["flink"]["checkpointing_interval_ms"] = args.checkpoint_ms
    config["postgres"]["first_copies_table"] = f"first_copies_{config['job']['name']}"
    kafka = config["kafka"]
    create_topic(kafka["bootstrap"], kafka["topic"], int(kafka["partitions"]))
    workdir = Path(config["iceberg"]["catalog"]["warehouse"].removeprefix("file://")).parent / "soak"
    workdir.mkdir(parents=True, exist_ok=True)
    job_id, _ = _submit(config, workdir, "benchmarks.soak_probe" if args.probe else "pipelines.clicks")
    rest = FlinkRest(config["flink"]["rest_url"])
    live = LiveProducer(config, args.rate, {p: 0 for p in range(int(kafka["partitions"]))}, seed=77, keep=False)
    live.start()
    t0 = time.monotonic()
    compaction = None
    if args.compact_every_min:
        compaction = CompactionSchedule(
            config, args.compact_every_min * 60, args.compact_sort_by, args.compact_row_group_rows, t0
        )
        compaction.start()
    samples: list[dict[str, Any]] = []
    savepoints: list[tuple[int, float]] = []  # (t_s, MB): at --from-minute and at the end
    restart: dict[str, Any] | None = None
    try:
        end = t0 + args.minutes * 60
        next_at = t0
        while True:
            time.sleep(max(0.0, next_at - time.monotonic()))
            if live.error is not None:
                raise RuntimeError(f"live producer failed: {live.error}")
            samples.append(sample_running(rest, job_id, states["flink"], config, t0))
            next_at += args.sample_s
            last = next_at > end + 1
            if (not savepoints and samples[-1]["t_s"] >= args.from_minute * 60) or last:
                savepoints.append((samples[-1]["t_s"], savepoint_mb(rest, job_id, workdir / "savepoints")))
                samples[-1]["savepoint_mb"] = savepoints[-1][1]
            print(json.dumps(samples[-1]), flush=True)
            if last:
                break
        counts = rest.checkpoints(job_id).get("counts", {})
        if args.restart_down_s:
            location = rest.stop_with_savepoint(job_id, str(workdir / "savepoints"), timeout=300)
            restart = restore_and_catch_up(
                rest, config, workdir, states["flink"], location, args.restart_down_s, args.rate
            )
            job_id = restart["job_id"]
    finally:
        live.stop()
        if compaction is not None:
            compaction.stop()
        rest.cancel(job_id)
    lines = report(samples, args.from_minute * 60)
    if compaction is not None:
        lines += compaction.report()
    if len(savepoints) >= 2:
        (t1, mb1), (t2, mb2) = savepoints[0], savepoints[-1]
        change = (mb2 - mb1) / mb1 if mb1 else float("nan")
        lines.append(
            f"live state (savepoint, canonical format) at {t1} s {mb1:.3f} MB, at {t2} s {mb2:.3f} MB: {change:+.1%} "
            f"({'met' if change < GOAL_GROWTH else 'MISSED'})"
        )
    lines.append(
        f"records produced {live.produced:,} at {args.rate:g}/s; checkpoints completed {counts.get('completed')}, "
        f"failed {counts.get('failed')}, restored {counts.get('restored')}"
    )
    if restart is not None:
        lines += restart["report"]
    print("\n".join(lines))
    if args.json:
        out = {
            "args": vars(args),
            "samples": samples,
            "report": lines,
            "restart": restart,
            "compactions": compaction.runs if compaction is not None else [],
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def resume(args: Any, states: dict[str, Any]) -> int:
    import yaml

    from beamflow.flink_rest import FlinkRest
    from benchmarks.flink_streaming import LiveProducer

    conf = Path(args.resume)
    config = yaml.safe_load(conf.read_text())
    savepoint = newest_savepoint(conf.parent)
    rest = FlinkRest(config["flink"]["rest_url"])
    partitions = int(config["kafka"]["partitions"])
    live = LiveProducer(config, args.rate, {p: 0 for p in range(partitions)}, seed=78, keep=False)
    live.start()
    restart: dict[str, Any] | None = None
    try:
        restart = restore_and_catch_up(
            rest, config, conf.parent, states["flink"], savepoint, args.restart_down_s, args.rate
        )
    finally:
        live.stop()
        if restart is not None:
            rest.cancel(restart["job_id"])
    if live.error is not None:
        raise RuntimeError(f"live producer failed: {live.error}")
    print("\n".join(restart["report"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "restart": restart}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
