"""beamflow beside the peer a user would pick instead (Quix Streams): same job, same data, same machine, same crashes.

    .venv/bin/python -m benchmarks.peers [--events 20000,200000] [--rounds 2] [--rounds-large N]
        [--drill-events 200000] [--drill-frameworks quix,beamflow] [--drill-parts crash,zombie]
        [--zombie-at F [--zombie-cpu]] [--quix-closing partition|key] [--json .data/peers/peers.json]
        [--plot docs/peers.png]
    .venv/bin/python -m benchmarks.peers --replot .data/peers/peers.json --plot docs/peers.png

Figures of the last run, and what they mean: docs/benchmarks.md, "Side by side with Quix Streams".

Throughput (interleaved rounds; each round runs every variant once on the same topic, the order rotating):

- ``baseline``: ``benchmarks.e2e``'s hand-written single-process loop (its ``--child baseline``);
- ``quix``: ``benchmarks/peers/quix_clicks.py`` in its own virtual environment (``.cache/peers/quix-venv``, created
  here with ``QUIX_PINS``), exactly-once processing guarantee;
- ``beamflow``: ``pipelines.clicks`` on the pinned local runner as ``benchmarks.e2e`` runs it (its
  ``--child beamflow``, which also times each fused stage);
- ``beamflow-flink``: ``pipelines.clicks --runner=FlinkRunner`` streaming on the local Flink cluster in the production
  shape (parallelism 2 over two TaskManagers, Python workers beside them, detached submission; ``FlinkRun``).

Each run is its own subprocess; wall seconds from the parent, CPU seconds (user+sys) from ``wait4``'s rusage of that
child, peak RSS from the child's own ``VmHWM`` (``beamflow/process_memory.py``: ``wait4``'s ``ru_maxrss`` is at least
the parent's RSS), so every variant is measured the same way. ``beamflow-flink`` cannot be one child: its work
runs in the cluster's processes, so its CPU seconds are theirs (TaskManagers with their Python workers, JobManager,
job server) plus the submitter's, from its submission until the group's committed offsets reach the topic's end,
and its peak memory is the largest sum of their RSS, sampled every 0.5 s (the JVMs' heaps included). Every run is
audited with the same independent queries (``audit_run``: a plain pyiceberg scan of the event ids, psql counts, the
group's committed offsets).

Crashes (``--drill-events``, 5% duplicate sends), applied identically to ``quix`` and ``beamflow``:

- *crash drill*: the job SIGKILLed at three random moments (fractions of its own undisturbed run time, the same
  fractions for both), rerun after each, then run to the end;
- *zombie*: instance A SIGSTOPped part-way (a seeded fraction of its undisturbed wall time, or ``--zombie-at`` of it,
  or with ``--zombie-cpu`` of its undisturbed CPU seconds), instance B started and run to the end, then A resumed
  (SIGCONT) and let finish (or killed after ``ZOMBIE_WAIT_S``). If B cannot finish while A is frozen, A is resumed
  after ``ZOMBIE_BLOCK_S`` anyway and B's block is recorded.

Then: events lost (produced event ids missing from Iceberg), event ids twice in Iceberg, sessions double-counted
(session rows of one user overlapping another, or one key twice), offsets committed vs end offsets.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from beamflow.kafka.confluent_backend import TUNED_DEFAULTS

REPO = Path(__file__).resolve().parents[1]
QUIX_VENV = REPO / ".cache" / "peers" / "quix-venv"
# The newest quixstreams PyPI served on 2026-12-01 (`pip index versions quixstreams`), with the extras the job uses;
# pyiceberg and psycopg pinned to what that resolved to.
QUIX_PINS = (
    "quixstreams[avro,iceberg,postgresql]==3.28.1",
    "pyiceberg[sql-sqlite,pyarrow,pyiceberg-core]==0.12.0",
    "psycopg[binary]==3.3.9",
)
QUIX_JOB = REPO / "benchmarks" / "peers" / "quix_clicks.py"
FLINK = "beamflow-flink"
VARIANTS = ("baseline", "quix", "beamflow", FLINK)
FLINK_PARALLELISM = 2
FRAMEWORKS = ("quix", "beamflow")
RUN_TIMEOUT_S = 1800
CODE_TREE = [REPO]  # set by main (--code)
ZOMBIE_WAIT_S = 240
ZOMBIE_BLOCK_S = 300.0  # B not finished this long after its start while A is frozen: A resumed anyway, B's block noted
QUIX_CLOSING = ["partition"]  # set by main (--quix-closing)
ZOMBIE_AT: list[float | None] = [None]  # set by main (--zombie-at); None: from the seed
DRILL_PARTS = {"crash", "zombie"}  # set by main (--drill-parts)
ZOMBIE_CPU = [False]  # set by main (--zombie-cpu): pause the zombie by CPU seconds used, not wall time
LARGE = 100_000  # --rounds-large applies from this many events on
# Quix tuning (see docs/benchmarks.md): the same librdkafka fetch settings beamflow's consumer uses, and a 5 s commit
# interval (Quix's default, and the baseline's Iceberg append interval).
QUIX_CONSUMER_CONFIG = dict(TUNED_DEFAULTS)


def quix_python() -> str:
    """The Quix job's interpreter: a venv of its own under the project's cache, created with ``QUIX_PINS``."""
    marker = QUIX_VENV / "pins.txt"
    python = QUIX_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(QUIX_VENV)], check=True)
    if not marker.exists() or marker.read_text() != "\n".join(QUIX_PINS):
        subprocess.run([str(python), "-m", "pip", "install", "-q", *QUIX_PINS], check=True)
        marker.write_text("\n".join(QUIX_PINS))
    return str(python)


def code_tree(workdir: Path, which: str) -> Path:
    """The code the baseline and beamflow children run: ``worktree`` (this checkout as it is) or a git ref.

    A ref is exported (``git archive``) into a folder of its own, so the measured code is exactly one commit even
    while others edit the shared working tree.
    """
    if which == "worktree":
        return REPO
    sha = subprocess.run(["git", "rev-parse", which], cwd=REPO, capture_output=True, text=True, check=True).stdout
    tree = workdir / f"tree-{sha.strip()[:10]}"
    if not (tree / "pipelines" / "clicks.py").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha.strip()], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


# ---- running one variant ---------------------------------------------------------------------------------------------


class Run:
    """One variant's subprocess: started now, measured with ``wait4`` (its own CPU seconds) and by its own report
    (peak RSS)."""

    def __init__(
        self, variant: str, config: dict[str, Any], workdir: Path, python_for_quix: str | None, tree: Path | None = None
    ) -> None:
        tree = tree or CODE_TREE[0]
        self.variant = variant
        path = workdir / f"{variant}-{uuid.uuid4().hex[:6]}.json"
        path.write_text(json.dumps(config))
        if variant == "quix":
            assert python_for_quix
            cmd = [python_for_quix, str(QUIX_JOB), str(path)]
        else:
            cmd = [sys.executable, "-m", "benchmarks.e2e", "--child", variant, str(path)]
        self.log = workdir / f"{path.stem}.log"
        self._out = self.log.open("w")
        self.started = time.perf_counter()
        # The beamflow children import the code under ``tree`` (a snapshot of HEAD by default, see code_tree).
        env = {**os.environ, "PYTHONPATH": str(tree)}
        # Its own process group: a signal reaches every process of the run (a local run split over processes).
        self.proc = subprocess.Popen(
            cmd, cwd=tree, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def cpu_s(self) -> float:
        """The child's user + sys CPU seconds so far (/proc), with its descendants' (a local run split over processes,
        live ones and the ones it waited for); 0 once it is gone."""
        stats: dict[int, list[str]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
        if self.proc.pid not in stats:
            return 0.0
        ticks, tree = 0, [self.proc.pid]
        while tree:
            pid = tree.pop()
            fields = stats[pid]
            ticks += sum(int(f) for f in fields[11:15])  # utime, stime, and of the children it waited for
            tree.extend(child for child, f in stats.items() if int(f[1]) == pid)
        return ticks / os.sysconf("SC_CLK_TCK")

    def wait_cpu(self, cpu_s: float, timeout: float) -> float:
        """Returns once the child has used ``cpu_s`` CPU seconds (or after ``timeout``); its CPU seconds then."""
        deadline = time.monotonic() + timeout
        while (used := self.cpu_s()) < cpu_s and time.monotonic() < deadline:
            time.sleep(0.05)
        return used

    def wait_exit(self, timeout: float) -> bool:
        """True once the child has exited (not reaped: ``wait`` still reads its rusage), False after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            time.sleep(0.1)
        return False

    def signal(self, sig: signal.Signals) -> None:
        """``sig`` to every process of the run (its process group): a zombie's SIGSTOP freezes a split local run's
        processes too, not only the command that waits for them; a SIGKILL ends them all at once, as a lost machine.
        """
        # os.killpg, not Popen.send_signal: that polls first, and a child that has just exited would be reaped there,
        # before wait4 can read its rusage. Only wait4 reaps, so the group's id cannot have been reused.
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> dict[str, Any]:
        """Waits for the child; returns wall/CPU/peak RSS and its RESULT line (if it printed one)."""
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                self.signal(signal.SIGKILL)
                pid, status, usage = os.wait4(self.proc.pid, 0)
                break
            time.sleep(0.05)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - self.started
        self._out.close()
        text = self.log.read_text(errors="replace")
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        child = json.loads(lines[-1][len("RESULT ") :]) if lines else {}
        return {
            "variant": self.variant,
            "returncode": self.proc.returncode,
            "seconds": seconds,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            # The child's own figure: wait4's ru_maxrss is at least this parent's RSS (beamflow/process_memory.py).
            # A child killed before it reported has none.
            "peak_rss_mb": float(child.get("peak_rss_mb", "nan")),
            "child": child,
            "tail": "" if self.proc.returncode == 0 else text[-2500:],
        }


class FlinkRun:
    """``beamflow-flink``: the streaming job submitted to the local cluster, measured until it has caught up.

    Done means the group's committed offsets reached the topic's end offsets on every partition: the read commits
    only what every sink holds (one completed checkpoint after it), so the sinks hold everything by then. The job
    is then cancelled (a streaming job does not end by itself); the audit runs after that, as for the others.
    """

    def __init__(self, config: dict[str, Any], workdir: Path, flink: Any) -> None:
        self.variant = FLINK
        self.config = config
        self.workdir = workdir
        self.flink = flink
        self.roots = list(flink.info["roles"].values())  # JobManager, TaskManagers, job server
        self.peak_mb = 0.0
        self._stop = threading.Event()

    def _cluster_pids(self) -> list[int]:
        from benchmarks.flink_streaming import _proc_table

        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        found, stack = [], list(self.roots)
        while stack:
            pid = stack.pop()
            if pid in table and pid not in found:
                found.append(pid)
                stack.extend(children.get(pid, []))
        return found

    def _sample_memory(self) -> None:
        from beamflow.process_memory import proc_rss_mb

        while not self._stop.wait(0.5):
            self.peak_mb = max(self.peak_mb, sum(proc_rss_mb(p) or 0.0 for p in self._cluster_pids()))

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> dict[str, Any]:
        import resource

        from beamflow.flink_rest import FlinkRest
        from beamflow.kafka.admin import end_offsets
        from benchmarks.flink_streaming import _submit, cpu_by_role
        from tests.flink.drill_support import committed_offsets

        kafka = self.config["kafka"]
        ends = end_offsets(kafka["bootstrap"], kafka["topic"])
        rest = FlinkRest(self.config["flink"]["rest_url"])
        sampler = threading.Thread(target=self._sample_memory, daemon=True)
        cluster_cpu = lambda: cpu_by_role({"flink": self.roots})["flink"]  # noqa: E731
        cpu0, children0 = cluster_cpu(), resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        sampler.start()
        job_id, tail, returncode = None, "", 0
        try:
            job_id, _ = _submit(self.config, self.workdir)  # waits for the submitter, then for RUNNING
            deadline = time.monotonic() + timeout
            while True:
                committed = committed_offsets(self.config)
                if all(committed.get(p, 0) >= end for p, end in ends.items()):
                    break
                if time.monotonic() > deadline or rest.job_state(job_id) != "RUNNING":
                    returncode, tail = 1, f"job {job_id} {rest.job_state(job_id)}; committed {committed}, ends {ends}"
                    break
                time.sleep(0.5)
            seconds = time.perf_counter() - started
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            # The cluster's CPU before the cancel (the Python workers exit with the job), plus the submitter's.
            cpu = (
                cluster_cpu()
                - cpu0
                + (children.ru_utime + children.ru_stime)
                - (children0.ru_utime + children0.ru_stime)
            )
        except Exception as exc:  # a failed submission is a failed run, reported like a child's
            seconds, cpu, returncode, tail = time.perf_counter() - started, 0.0, 1, repr(exc)[-2500:]
        finally:
            self._stop.set()
            sampler.join(5)
            if job_id:
                rest.cancel(job_id)
                rest.wait_for_state(job_id, {"CANCELED"}, timeout=120)
        return {
            "variant": self.variant,
            "returncode": returncode,
            "seconds": seconds,
            "cpu_s": cpu,
            "peak_rss_mb": self.peak_mb,
            "child": {},
            "tail": tail,
        }


def flink_variant_config(base: dict[str, Any], tag: str, workdir: Path, flink: Any) -> dict[str, Any]:
    """The beamflow variant's config (tables of its own), streaming, with ``conf/flink.yaml``'s settings as shipped
    at ``FLINK_PARALLELISM`` and the local cluster's endpoints."""
    from beamflow.config import load_config
    from benchmarks.flink_streaming import LOCAL_KEYS
    from runners.flink import service_settings

    config = variant_config(base, FLINK, tag, workdir)
    shipped = {k: v for k, v in load_config(REPO / "conf" / "clicks.yaml")["flink"].items() if k not in LOCAL_KEYS}
    config["flink"] = {
        **shipped,
        **service_settings(flink),
        "rest_url": flink.info["rest_url"],
        "parallelism": FLINK_PARALLELISM,
        "job_name": f"peers-{tag}",
    }
    config["kafka"]["bounded"] = False
    config["job"] = {**config.get("job", {}), "name": f"peers_{tag}"}
    return config


# ---- the audit: the same independent queries for every framework ----------------------------------------------------


def overlapping_sessions_sql(table: str) -> str:
    """Session rows of one user whose intervals overlap another row's: the same events counted in two sessions."""
    return (
        f'SELECT count(*) FROM "{table}" a JOIN "{table}" b ON a.user_id = b.user_id '
        "AND a.session_start < b.session_start AND b.session_start < a.session_end"
    )


def summarize_audit(found: dict[str, Any], expected: dict[str, int], overlapping: int) -> dict[str, Any]:
    """What the issue asks of every run: lost, twice, sessions double-counted, offsets (from ``e2e.audit``'s counts)."""
    ends, committed = found["end_offsets"], found["committed_offsets"]
    return {
        "lost": expected["events"] - found["iceberg_ids"],
        "ids_twice": found["iceberg_rows"] - found["iceberg_ids"],
        "sessions_double_counted": overlapping + max(found["session_keys_twice"], 0),
        "session_events": found["session_events"],
        "sessions": found["sessions"],
        "quarantined": found["quarantined"],
        "dead_letters": found["dead_letters"],
        "offsets_behind": sum(max(0, int(end) - max(int(committed.get(p, -1) or -1), 0)) for p, end in ends.items()),
        "offsets_ahead": sum(max(0, int(committed.get(p, -1) or -1) - int(end)) for p, end in ends.items()),
    }


def audit_run(config: dict[str, Any], expected: dict[str, int]) -> dict[str, Any]:
    import psycopg

    from benchmarks.e2e import audit

    found = audit(config, expected)
    # e2e.audit reads committed offsets keyed by partition number; JSON round trips make them strings elsewhere.
    found["end_offsets"] = {int(k): v for k, v in found["end_offsets"].items()}
    found["committed_offsets"] = {int(k): v for k, v in found["committed_offsets"].items()}
    with psycopg.connect(config["postgres"]["dsn"], autocommit=True) as conn:
        try:
            row = conn.execute(overlapping_sessions_sql(config["postgres"]["sessions_table"])).fetchone()
            overlapping = int(row[0]) if row else 0
        except psycopg.errors.UndefinedTable:
            overlapping = 0
    return summarize_audit(found, expected, overlapping)


# ---- the parent ------------------------------------------------------------------------------------------------------


def variant_config(base: dict[str, Any], variant: str, tag: str, workdir: Path) -> dict[str, Any]:
    from benchmarks.e2e import _variant_config

    config = _variant_config(base, variant, tag)
    if variant == "quix":
        state = workdir / "quix-state" / tag
        state.mkdir(parents=True, exist_ok=True)
        # Quix writes with its own pyiceberg (another version): its own SQLite catalog, the same warehouse.
        catalog_uri = f"sqlite:///{workdir / 'iceberg' / 'quix_catalog.db'}"
        (workdir / "iceberg").mkdir(parents=True, exist_ok=True)
        config["iceberg"]["catalog"]["uri"] = catalog_uri
        config["quix"] = {
            "state_dir": str(state),
            "catalog_uri": catalog_uri,
            "commit_interval_s": 5.0,
            "consumer_extra_config": QUIX_CONSUMER_CONFIG,
            "idle_timeout_s": 60.0,
            "closing_strategy": QUIX_CLOSING[0],
        }
    return config


def produce(base: dict[str, Any], events: int, duplicate_share: float, tag: str) -> tuple[str, dict[str, int], int]:
    from beamflow.generate import TrafficSpec, avro_click_encoder, generate_traffic, produce_traffic
    from beamflow.kafka.admin import create_topic

    topic = f"peers-{tag}"
    spec = TrafficSpec(
        events=events, partitions=int(base["kafka"].get("partitions", 4)), duplicate_share=duplicate_share
    )
    create_topic(base["kafka"]["bootstrap"], topic, spec.partitions)
    traffic = generate_traffic(spec, avro_click_encoder(base["registry"]["url"], base["registry"]["subject"]))
    produce_traffic(base["kafka"]["bootstrap"], topic, traffic)
    expected = {k: int(traffic.counts[k]) for k in ("events", "duplicate_sends", "bad_records")}
    return topic, expected, len(traffic.records)


def throughput(
    base: dict[str, Any],
    workdir: Path,
    sizes: list[int],
    rounds: int,
    variants: list[str],
    qpy: str,
    rounds_large: int | None = None,
    flink: Any = None,
) -> list[dict[str, Any]]:
    out = []
    for size in sizes:
        size_rounds = rounds_large if rounds_large is not None and size >= LARGE else rounds
        tag = uuid.uuid4().hex[:6]
        topic, expected, records = produce(base, size, 0.02, f"{size}-{tag}")
        print(f"\n{records:,} records ({size:,} events) in {topic}; load average {os.getloadavg()[0]:.1f}", flush=True)
        for r in range(size_rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for variant in order:
                on_topic = {**base, "kafka": {**base["kafka"], "topic": topic}}
                load_before = os.getloadavg()[0]
                if variant == FLINK:
                    config = flink_variant_config(on_topic, f"{tag}r{r}", workdir, flink)
                    result = FlinkRun(config, workdir, flink).wait()
                else:
                    config = variant_config(on_topic, variant, f"{tag}r{r}", workdir)
                    result = Run(variant, config, workdir, qpy).wait()
                result.update(events=size, records=records, round=r, load=load_before, load_after=os.getloadavg()[0])
                result["audit"] = audit_run(config, expected)
                out.append(result)
                a = result["audit"]
                print(
                    f"  [{size:,} r{r}] {variant:14} {result['seconds']:6.1f}s "
                    f"{records / result['seconds']:8,.0f} rec/s "
                    f"CPU {result['cpu_s']:6.1f}s ({records / max(result['cpu_s'], 1e-9):7,.0f} rec/CPU s) "
                    f"peak {result['peak_rss_mb']:5.0f} MB load {load_before:4.1f} rc={result['returncode']} | lost "
                    f"{a['lost']} twice {a['ids_twice']} sess {a['sessions']} ({a['session_events']} ev) dbl "
                    f"{a['sessions_double_counted']} quar {a['quarantined']}/{expected['duplicate_sends']} dead "
                    f"{a['dead_letters']}/{expected['bad_records']} behind {a['offsets_behind']}",
                    flush=True,
                )
                if result["returncode"] != 0:
                    print(result["tail"], flush=True)
    return out


def crash_drill(
    base: dict[str, Any], workdir: Path, events: int, frameworks: list[str], qpy: str, seed: int
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    topic, expected, records = produce(base, events, 0.05, f"drill-{events}-{tag}")
    rng = random.Random(seed)
    fractions = sorted(rng.uniform(0.1, 0.9) for _ in range(3))
    zombie_at = rng.uniform(0.2, 0.6)
    if ZOMBIE_AT[0] is not None:
        zombie_at = ZOMBIE_AT[0]
    print(
        f"\ncrash drills: {records:,} records ({events:,} events, {expected['duplicate_sends']} duplicate sends) in "
        f"{topic}; kills at {[round(f, 2) for f in fractions]} of each job's own run time; zombie paused at "
        f"{zombie_at:.2f}",
        flush=True,
    )
    out: dict[str, Any] = {"events": events, "records": records, "expected": expected, "fractions": fractions}
    for framework in frameworks:
        with_topic = {**base, "kafka": {**base["kafka"], "topic": topic}}
        # The undisturbed run time, on its own group and tables: the kill moments are fractions of it.
        probe_config = variant_config(with_topic, framework, f"{tag}p", workdir)
        probe = Run(framework, probe_config, workdir, qpy).wait()
        probe["audit"] = audit_run(probe_config, expected)
        duration = probe["seconds"]
        config = variant_config(with_topic, framework, f"{tag}c", workdir)
        kills = []
        for fraction in fractions if "crash" in DRILL_PARTS else ():
            run = Run(framework, config, workdir, qpy)
            time.sleep(fraction * duration)
            run.signal(signal.SIGKILL)
            kills.append(run.wait()["seconds"])
        final = Run(framework, config, workdir, qpy).wait() if "crash" in DRILL_PARTS else {"returncode": None}
        crash_audit = audit_run(config, expected)
        drill = {"probe": probe, "kill_after_s": kills, "final": final, "audit": crash_audit}
        clean = probe["audit"]
        print(f"  {framework} undisturbed ({duration:.0f}s, rc={probe['returncode']}): {_audit_line(clean, expected)}")
        print(
            f"  {framework} crash drill (killed after {[round(k, 1) for k in kills]} s, "
            f"final rc={final['returncode']}):"
            f" {_audit_line(crash_audit, expected, clean)}",
            flush=True,
        )
        # Zombie: A paused part-way, B runs to the end, A resumed.
        zconfig = variant_config(with_topic, framework, f"{tag}z", workdir)
        if framework == "quix":
            zconfig_b = json.loads(json.dumps(zconfig))
            zconfig_b["quix"]["state_dir"] = zconfig["quix"]["state_dir"] + "-b"  # another pod, another disk
        else:
            zconfig_b = zconfig
        a = Run(framework, zconfig, workdir, qpy)
        if ZOMBIE_CPU[0]:
            # Paused once A has used this share of its undisturbed run's CPU seconds: past its start-up, reading and
            # writing, whatever the machine's load (a wall-clock fraction can fall inside a slow start-up).
            a.wait_cpu(zombie_at * probe["cpu_s"], timeout=duration * 3)
        else:
            time.sleep(zombie_at * duration)
        a.signal(signal.SIGSTOP)
        paused = {"after_s": time.perf_counter() - a.started, "cpu_s": a.cpu_s()}
        print(f"  {framework} zombie A paused after {paused['after_s']:.1f} s, {paused['cpu_s']:.1f} CPU s", flush=True)
        b_run = Run(framework, zconfig_b, workdir, qpy)
        # B may be unable to finish while A is frozen (A holding a sink's transaction open, say): after
        # ZOMBIE_BLOCK_S without B finishing, A is resumed anyway and B's block is recorded.
        b_done = b_run.wait_exit(ZOMBIE_BLOCK_S)
        a.signal(signal.SIGCONT)
        resumed = time.perf_counter() - a.started
        if not b_done:
            print(f"  {framework} zombie: B not done {ZOMBIE_BLOCK_S:.0f} s after its start with A frozen", flush=True)
        b = b_run.wait()
        b["blocked_by_frozen_a"] = not b_done
        paused["resumed_after_s"] = resumed
        a_result = a.wait(timeout=ZOMBIE_WAIT_S)
        zombie = {"a": a_result, "b": b, "paused": paused, "audit": audit_run(zconfig, expected)}
        print(
            f"  {framework} zombie (A rc={a_result['returncode']}, read {a_result['child'].get('records')}; "
            f"B rc={b['returncode']}, read {b['child'].get('records')}): "
            f"{_audit_line(zombie['audit'], expected, clean)}",
            flush=True,
        )
        out[framework] = {"crash": drill, "zombie": zombie}
    return out


def versus_clean(a: dict[str, Any], clean: dict[str, Any]) -> dict[str, int]:
    """A disturbed run's sessions against the same framework's undisturbed run of the same topic.

    Both frameworks' sessions are deterministic given the input, so any extra session row, extra event counted in
    sessions or extra overlapping pair is a double count the crash made (fewer: sessions lost).
    """
    return {
        "session_rows_extra": a["sessions"] - clean["sessions"],
        "session_events_extra": a["session_events"] - clean["session_events"],
        "double_counted_extra": a["sessions_double_counted"] - clean["sessions_double_counted"],
    }


def _audit_line(a: dict[str, Any], expected: dict[str, int], clean: dict[str, Any] | None = None) -> str:
    line = (
        f"lost {a['lost']}, ids twice in Iceberg {a['ids_twice']}, sessions double-counted "
        f"{a['sessions_double_counted']}, quarantined {a['quarantined']}/{expected['duplicate_sends']}, dead letters "
        f"{a['dead_letters']}/{expected['bad_records']}, sessions {a['sessions']} ({a['session_events']}/"
        f"{expected['events']} events), offsets behind end {a['offsets_behind']}"
    )
    if clean is not None:
        d = versus_clean(a, clean)
        line += (
            f"; against the undisturbed run: session rows {d['session_rows_extra']:+d}, events in sessions "
            f"{d['session_events_extra']:+d}, overlapping {d['double_counted_extra']:+d}"
        )
    return line


def processed(run: dict[str, Any]) -> int:
    """Records the child says it processed (a run stopped early processed fewer than the topic holds)."""
    return int(run["child"].get("records") or run["records"])


def summary_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (events, variant): median records/s, records per CPU second, peak RSS, ratio to the same round's baseline."""
    import statistics

    rows = []
    for size in sorted({r["events"] for r in runs}):
        for variant in VARIANTS:
            mine = [r for r in runs if r["events"] == size and r["variant"] == variant]
            if not mine:
                continue

            def same_round(r: dict[str, Any], other: str, size: int = size) -> list[float]:
                """other's wall seconds / r's in r's round (empty if other did not run then)."""
                return [
                    x["seconds"] / r["seconds"]
                    for x in runs
                    if x["events"] == size and x["round"] == r["round"] and x["variant"] == other
                ]

            ratios = [x for r in mine for x in same_round(r, "baseline")]
            over_quix = [x for r in mine for x in same_round(r, "quix")]
            rows.append(
                {
                    "events": size,
                    "variant": variant,
                    "records": mine[0]["records"],
                    "rec_s": statistics.median(processed(r) / r["seconds"] for r in mine),
                    "rec_cpu_s": statistics.median(processed(r) / max(r["cpu_s"], 1e-9) for r in mine),
                    "processed": min(processed(r) for r in mine),
                    "peak_mb": max(r["peak_rss_mb"] for r in mine),
                    "x_baseline": statistics.median(ratios) if ratios else float("nan"),
                    "x_quix": statistics.median(over_quix) if over_quix else float("nan"),
                    "seconds": [round(r["seconds"], 1) for r in mine],
                    "lost": max(r["audit"]["lost"] for r in mine),
                    "twice": max(r["audit"]["ids_twice"] for r in mine),
                    "load": statistics.median(r["load"] for r in mine),
                }
            )
    return rows


def plot(figures: dict[str, Any], path: str) -> None:
    """Records/s, records per CPU second and peak RSS per variant and size; the drills' audit if they ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = figures["summary"]
    drills = figures.get("drills")
    sizes = sorted({r["events"] for r in rows})
    fig, axes = plt.subplots(1, 4 if drills else 3, figsize=(20 if drills else 15, 4.8))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        for ax, key, label in (
            (axes[0], "rec_s", "records/s (median of rounds)"),
            (axes[1], "rec_cpu_s", "records per CPU second (median)"),
            (axes[2], "peak_mb", "peak RSS, MB (max of rounds)"),
        ):
            values = [next((r[key] for r in rows if r["events"] == s and r["variant"] == variant), 0) for s in sizes]
            bars = ax.bar([j + i * width for j in range(len(sizes))], values, width, label=variant)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
            ax.set_title(label, fontsize=10)
            ax.set_xticks(
                [j + width * (len(VARIANTS) - 1) / 2 for j in range(len(sizes))], [f"{s:,} events" for s in sizes]
            )
    for row in rows:
        if row.get("processed", row["records"]) < row["records"]:  # a run stopped before the end of the topic
            j, i = sizes.index(row["events"]), VARIANTS.index(row["variant"])
            axes[0].annotate(
                f"{row['variant']} stopped:\n{row['processed']:,} of\n{row['records']:,} records\n"
                f"in {row['seconds'][0]:.0f} s",
                (j + i * width, row["rec_s"]),
                xytext=(0, 30),
                textcoords="offset points",
                ha="center",
                fontsize=7,
                arrowprops={"arrowstyle": "->"},
            )
    axes[0].legend(fontsize=8)
    if drills:
        ax = axes[3]
        labels, lost, twice, extra = [], [], [], []
        for framework in FRAMEWORKS:
            if framework not in drills:
                continue
            clean = drills[framework]["crash"]["probe"]["audit"]
            for what in ("crash", "zombie"):
                a = drills[framework][what]["audit"]
                labels.append(f"{framework}\n{what}")
                lost.append(a["lost"])
                twice.append(a["ids_twice"])
                extra.append(max(0, versus_clean(a, clean)["session_events_extra"]))
        x = range(len(labels))
        for k, (values, label) in enumerate(
            ((lost, "events lost"), (twice, "ids twice in Iceberg"), (extra, "events counted twice in sessions"))
        ):
            bars = ax.bar([j + k * 0.27 for j in x], values, 0.27, label=label)
            ax.bar_label(bars, fontsize=7)
        ax.set_xticks([j + 0.27 for j in x], labels, fontsize=8)
        ax.set_title(
            f"crash drill (3 SIGKILLs) and zombie, {drills['events']:,} events + 5% duplicate sends", fontsize=9
        )
        ax.legend(fontsize=7)
    load = figures.get("load_during") or figures["load"]
    fig.suptitle(
        "clicks job: hand-written baseline, Quix Streams 3.28.1 (exactly-once), beamflow local runner, beamflow "
        f"streaming on Flink (p{FLINK_PARALLELISM}); nproc 2, load average {min(load):.0f} to {max(load):.0f}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", default="20000,200000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--rounds-large", type=int, help=f"rounds at {LARGE:,} events and more (default: --rounds); Quix is slow there"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--drill-events", type=int, default=200000, help="0: no crash drills")
    parser.add_argument("--drill-frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument(
        "--zombie-at", type=float, help="pause the zombie at this fraction of its run (default: seeded)"
    )
    parser.add_argument("--drill-parts", default="crash,zombie", help="crash, zombie or both")
    parser.add_argument(
        "--zombie-cpu",
        action="store_true",
        help="pause the zombie once it used --zombie-at of its undisturbed run's CPU seconds (not of its wall time)",
    )
    parser.add_argument(
        "--quix-closing",
        default="partition",
        choices=("partition", "key"),
        help="Quix session closing strategy (key: cheaper, but a quiet user's last session is never emitted)",
    )
    parser.add_argument("--json", default=".data/peers/peers.json")
    parser.add_argument("--plot")
    parser.add_argument("--replot", metavar="JSON", help="only redraw --plot from a saved --json")
    parser.add_argument("--keep-services", action="store_true")
    parser.add_argument(
        "--code", default="HEAD", help="git ref the baseline and beamflow run (exported), or 'worktree' (default HEAD)"
    )
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        saved.setdefault("load_during", [r["load"] for r in saved["runs"]] + [saved["load_at_end"][0]])
        saved["summary"] = summary_rows(saved["runs"])
        _save(args.replot, saved)
        plot(saved, args.plot or "docs/peers.png")
        return 0

    from beamflow.config import load_config, resolve_auto
    from beamflow.services import ServiceSet
    from beamflow.services.paths import data_dir

    QUIX_CLOSING[0] = args.quix_closing
    ZOMBIE_AT[0] = args.zombie_at
    ZOMBIE_CPU[0] = args.zombie_cpu
    DRILL_PARTS.clear()
    DRILL_PARTS.update(args.drill_parts.split(","))
    qpy = quix_python()
    workdir = Path(data_dir()) / "peers"
    workdir.mkdir(parents=True, exist_ok=True)
    CODE_TREE[0] = code_tree(workdir, args.code)
    print(f"baseline and beamflow run the code in {CODE_TREE[0]}", flush=True)
    services = ServiceSet(data=workdir)
    names = ["kafka", "postgres", "registry"]
    with_flink = FLINK in args.variants.split(",")
    if with_flink:
        names.append("flink")
    try:
        states = {name: services.get(name).up() for name in names}
        conf = load_config("conf/clicks.yaml")
        conf.pop("flink", None)  # the local runner's and Quix's job: no Flink endpoints to resolve
        base = resolve_auto(conf, services)
        base["kafka"]["bounded"] = True
        load_at_start = os.getloadavg()
        print(f"nproc={os.cpu_count()}, load average {load_at_start}", flush=True)
        sizes = [int(s) for s in args.events.split(",") if s]
        runs = (
            throughput(
                base, workdir, sizes, args.rounds, args.variants.split(","), qpy, args.rounds_large, states.get("flink")
            )
            if sizes
            else []
        )
        figures: dict[str, Any] = {"load": load_at_start, "runs": runs, "summary": summary_rows(runs) if runs else []}
        _save(args.json, figures)
        if args.drill_events:
            figures["drills"] = crash_drill(
                base, workdir, args.drill_events, args.drill_frameworks.split(","), qpy, args.seed
            )
        figures["load_at_end"] = os.getloadavg()
        _save(args.json, figures)
        print(
            f"\n{'events':>8} {'variant':14} {'rec/s':>8} {'x base':>6} {'x quix':>6} {'rec/CPU s':>9} {'peak MB':>7} "
            "lost twice  wall s (rounds)"
        )
        for r in figures["summary"]:
            print(
                f"{r['events']:8,} {r['variant']:14} {r['rec_s']:8,.0f} {r['x_baseline']:6.2f} {r['x_quix']:6.2f} "
                f"{r['rec_cpu_s']:9,.0f} {r['peak_mb']:7.0f} {r['lost']:4} {r['twice']:5}  {r['seconds']}"
            )
        print(f"load average at start {load_at_start}, at end {figures['load_at_end']}")
        if args.plot and figures["summary"]:
            plot(figures, args.plot)
            print(f"plot written to {args.plot}")
    finally:
        if not args.keep_services:
            services.down(names)
    return 0


def _save(path: str, figures: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
