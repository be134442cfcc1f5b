"""The streaming clicks job on Flink in the production shape: catch-up of a backlog, sustained rate, checkpoints, lag,
produce-to-visible latency, against the DirectRunner job on the same data, measured and audited in one run.

    BEAMFLOW_DATA=$PWD/.data/bench-flink .venv/bin/python -m benchmarks.flink_streaming \
        [--events 200000] [--live-rate 500] [--parallelism 1,2] [--rounds 1] [--warmup-events 20000] [--json F] \
        [--plot docs/flink_streaming.png]

Every variant gets its own topic, consumer group, PostgreSQL tables (sessions, dead letters, quarantine, first copies)
and Iceberg table, and the same backlog: ``beamflow.generate`` traffic with its defaults (skew, late and too-late
events, an idle partition, schema v2 from the middle, bad records of every kind) plus 5% duplicate sends.

- ``direct``: ``pipelines.clicks`` on the pinned local runner (bounded read of the backlog), run through
  ``benchmarks.e2e``'s child (``run_with_config`` timed in a subprocess, as ``benchmarks.e2e`` measures it).
- ``p1``, ``p2``: ``python -m pipelines.clicks --runner=FlinkRunner`` submitted detached to the local session cluster
  (two TaskManagers, Python SDK workers beside them: PROCESS environment), with ``conf/flink.yaml``'s shipped
  settings except the parallelism, one after the other on the same cluster. The backlog is in Kafka before the
  submission; live traffic (fresh events, same kinds of trouble, event time = now) is produced at ``--live-rate`` from
  a thread from the submission until ``--steady-s`` after the job keeps up with it (the lag back within two
  checkpoint intervals of live records, once the backlog and the live records produced meanwhile are through).

Figures: time to catch up (job RUNNING -> every backlog record is in its sink and the group's committed offsets reached
the backlog's end offsets), records/s consumed (committed offsets sampled every second: over the whole catch-up, and
"sustained" = the slope between 10% and 90% of the backlog committed; the offsets move once per checkpoint, so the
same slope is also taken from the moments the backlog's events became visible in Iceberg, which the sink commits about
once a second per subtask), consumer lag over time, every checkpoint's duration with its alignment / sync / async parts
(Flink REST, the slowest subtask of each vertex), busy and backpressured time per vertex, CPU seconds per process role
from /proc and the whole machine's busy cores (/proc/stat: p1's busy cores give the ceiling this machine leaves p2 /
p1, cores / busy cores; over the whole catch-up and, sampled every second, over the span the Iceberg measure covers),
and the latency from produce to visible:
in Iceberg for every live event (the commit time of the first snapshot whose added files hold its event id, read after
the run), and in the PostgreSQL sessions table for sampled live events (polled: a session row of the user whose
offset ranges hold the event's Kafka coordinates). Each variant is audited as the Flink tests do
(``tests.flink.drill_support.check_exactly_once``, overlapping sessions); a failed audit marks the run invalid (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GOALS = {"p2_over_p1": 1.7, "p1_over_direct": 0.5, "checkpoint_over_interval": 1.0, "iceberg_p99_over_2x_interval": 1.0}
# What conf/flink.yaml ships and the variants run with, apart from the parallelism and the local endpoints.
LOCAL_KEYS = ("job_endpoint", "environment", "files_to_stage")
SAMPLE_EVERY = 50  # every 50th live event (first copies only) is polled for in the sessions table
TICK_S = 0.1


def _now_ms() -> int:
    return int(time.time() * 1000)


# ---- live traffic ---------------------------------------------------------------------------------------------------


class LiveProducer(threading.Thread):
    """Produces fresh traffic at ``rate`` records/s in production order, remembering what it sent and when.

    Chunks of ``rate * 10`` events are generated ahead (same spec as the backlog, event time = now, one bad record of
    each kind per chunk, no idle partition). ``offsets`` continues the per-partition offsets after the backlog, so each
    record's Kafka coordinates are known (records of a partition get consecutive offsets in production order).
    """

    def __init__(
        self, config: dict[str, Any], rate: float, next_offsets: dict[int, int], seed: int, keep: bool = True
    ) -> None:
        super().__init__(daemon=True)
        self.config, self.rate, self.seed = config, rate, seed
        self.next_offsets = dict(next_offsets)
        # Each record sent, for an audit; a soak of hours keeps none (10 million records would be gigabytes).
        self.keep = keep
        self.produced = 0
        self.records: list[Any] = []
        self.counts: Counter[str] = Counter()
        self.sent_ms: list[int] = []  # per record of self.records
        self.samples: list[dict[str, Any]] = []  # first copies to poll for in the sessions table
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(60)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the benchmark
            self.error = exc

    def _run(self) -> None:
        from confluent_kafka import Producer

        from beamflow.event_id import event_id_from_fields
        from beamflow.generate import EVENT_ID_FIELDS, TrafficSpec, avro_click_encoder, generate_traffic

        kafka = self.config["kafka"]
        producer = Producer(
            {"bootstrap.servers": kafka["bootstrap"], "linger.ms": 5, "acks": "all", "enable.idempotence": True}
        )
        errors: list[str] = []

        def on_delivery(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        encode = avro_click_encoder(self.config["registry"]["url"], self.config["registry"]["subject"])
        per_tick = max(1, round(self.rate * TICK_S))
        chunk_events = max(100, int(self.rate * 10))
        last_ms = _now_ms()
        chunk_no = 0
        first_copies = 0
        start = time.monotonic()
        sent = 0
        while not self._halt.is_set():
            spec = TrafficSpec(
                events=chunk_events,
                partitions=int(kafka["partitions"]),
                duplicate_share=0.05,
                idle_partition=None,
                bad_per_kind=1,
                step_ms=max(1, int(1000 / self.rate)),
                start_ms=max(_now_ms(), last_ms + 1),
                seed=self.seed + chunk_no,
            )
            chunk_no += 1
            traffic = generate_traffic(spec, encode)
            last_ms = max(r.timestamp_ms for r in traffic.records)
            self.counts.update({k: v for k, v in traffic.counts.items() if k != "records"})
            records = traffic.records
            for begin in range(0, len(records), per_tick):
                if self._halt.is_set():
                    # The rest of this chunk is never sent: take its counts back (the audit expects what was sent).
                    self._uncount(records[begin:])
                    break
                ahead = sent / self.rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
                tick = records[begin : begin + per_tick]
                at = _now_ms()
                for r in tick:
                    offset = self.next_offsets[r.partition]
                    self.next_offsets[r.partition] = offset + 1
                    producer.produce(
                        kafka["topic"],
                        key=r.key,
                        value=r.value,
                        partition=r.partition,
                        timestamp=r.timestamp_ms,
                        on_delivery=on_delivery,
                    )
                    self.produced += 1
                    if self.keep:
                        self.records.append(r)
                        self.sent_ms.append(at)
                    if (
                        r.event is not None and r.kind == "event" and r.timestamp_ms >= at - 60_000
                    ):  # on time: late ones are not sampled
                        first_copies += 1
                        if first_copies % SAMPLE_EVERY == 0:
                            self.samples.append(
                                {
                                    "event_id": event_id_from_fields(r.event, EVENT_ID_FIELDS),
                                    "user_id": r.event["user_id"],
                                    "partition": r.partition,
                                    "offset": offset,
                                    "click": r.event["event_type"] == "click",
                                    "sent_ms": at,
                                    "sessions_ms": None,
                                }
                            )
                producer.poll(0)
                sent += len(tick)
        if producer.flush(60) or errors:
            raise RuntimeError(f"live producer: {len(errors)} failed deliveries, e.g. {errors[:3]}")

    def _uncount(self, unsent: list[Any]) -> None:
        for r in unsent:
            if r.kind == "event":
                self.counts["events"] -= 1
                self.counts[f"events_v{r.schema_version}"] -= 1
            elif r.kind == "duplicate":
                self.counts["duplicate_sends"] -= 1
            else:
                self.counts["bad_records"] -= 1
                self.counts[r.kind] -= 1


# ---- sampling while a variant runs ---------------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, user+sys CPU seconds, command line) for every process visible in /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[int, float, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmd)
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, every process: /proc/stat minus idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(roots: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each role: its root pids and all their descendants. Python SDK workers (descendants of
    the TaskManagers whose command line runs Python) are their own role."""
    table = _proc_table()
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _, _) in table.items():
        children[ppid].append(pid)
    out: dict[str, float] = defaultdict(float)
    for role, pids in roots.items():
        stack = list(pids)
        seen: set[int] = set()
        while stack:
            pid = stack.pop()
            if pid in seen or pid not in table:
                continue
            seen.add(pid)
            _, cpu, cmd = table[pid]
            name = role
            if role == "taskmanagers" and pid not in pids:
                name = "python_workers" if "python" in cmd or "sdk_worker" in cmd else "boot_and_other_tm_children"
            out[name] += cpu
            stack.extend(children.get(pid, []))
    out["this_benchmark"] = table.get(os.getpid(), (0, 0.0, ""))[1]
    return dict(out)


class Sampler(threading.Thread):
    """Every second: the group's committed offsets and the end offsets. Every few seconds: backlog records in the
    PostgreSQL sinks, sampled live events in the sessions table, checkpoints (details fetched once per checkpoint),
    busy / backpressured time per vertex."""

    def __init__(self, config: dict[str, Any], job_id: str, backlog_end: dict[int, int], live: LiveProducer) -> None:
        super().__init__(daemon=True)
        self.config, self.job_id, self.backlog_end, self.live = config, job_id, backlog_end, live
        self.t0 = time.time()
        self.offsets: list[tuple[float, int, int]] = []  # (s since t0, committed total, end total)
        self.committed_at_end: float | None = None  # s since t0 when committed >= backlog end on every partition
        self.pg_backlog_at: float | None = None  # s since t0 when quarantine + dead letters held every backlog record
        self.expected_pg: int = 0
        self.checkpoints: dict[int, dict[str, Any]] = {}
        self.vertex_samples: list[tuple[float, dict[str, dict[str, float]]]] = []
        self.busy: list[tuple[float, float]] = []  # (epoch s, the machine's busy CPU s so far), every second
        self.errors: list[str] = []
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(60)

    def run(self) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from beamflow.flink_rest import FlinkRest

        kafka = self.config["kafka"]
        consumer = Consumer(
            {"bootstrap.servers": kafka["bootstrap"], "group.id": kafka["group_id"], "enable.auto.commit": False}
        )
        rest = FlinkRest(self.config["flink"]["rest_url"], timeout=10)
        tps = [TopicPartition(kafka["topic"], p) for p in range(int(kafka["partitions"]))]
        n = 0
        try:
            while not self._halt.is_set():
                tick = time.monotonic()
                self.busy.append((time.time(), machine_busy_s()))
                try:
                    self._offsets(consumer, tps)
                    if n % 2 == 0:
                        self._postgres()
                        self._checkpoints(rest)
                    if n % 5 == 0:
                        self._vertices(rest)
                except Exception as exc:  # one missed sample is fine; all are listed
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                n += 1
                self._halt.wait(max(0.0, 1.0 - (time.monotonic() - tick)))
            with contextlib.suppress(Exception):
                self._checkpoints(rest)
        finally:
            consumer.close()

    def _offsets(self, consumer: Any, tps: list[Any]) -> None:
        ends = [consumer.get_watermark_offsets(tp, timeout=5, cached=False)[1] for tp in tps]
        committed = {tp.partition: max(tp.offset, 0) for tp in consumer.committed(tps, timeout=5)}
        at = time.time() - self.t0
        self.offsets.append((round(at, 2), sum(committed.values()), sum(ends)))
        if self.committed_at_end is None and all(committed.get(p, 0) >= e for p, e in self.backlog_end.items()):
            self.committed_at_end = at

    def _postgres(self) -> None:
        import psycopg
        from psycopg import sql

        pg = self.config["postgres"]
        ends = sql.SQL(" ").join(
            sql.SQL("WHEN {} THEN {}").format(sql.Literal(p), sql.Literal(e)) for p, e in self.backlog_end.items()
        )
        pending = [s for s in list(self.live.samples) if s["sessions_ms"] is None]
        with psycopg.connect(pg["dsn"], autocommit=True) as conn:
            if self.pg_backlog_at is None:
                held = 0
                for key in ("quarantine_table", "dead_letters_table"):
                    with contextlib.suppress(psycopg.errors.UndefinedTable):
                        row = conn.execute(
                            sql.SQL("SELECT count(*) FROM {} WHERE kafka_offset < CASE kafka_partition {} END").format(
                                sql.Identifier(pg[key]), ends
                            )
                        ).fetchone()
                        held += int(row[0]) if row else 0
                if held >= self.expected_pg:
                    self.pg_backlog_at = time.time() - self.t0
            if pending:
                self._sessions(conn, pending)

    def _sessions(self, conn: Any, pending: list[dict[str, Any]]) -> None:
        """An event is visible in the session rows once the sessions' events ledger holds it: the store claims it
        there in the transaction that adds it to its session."""
        import psycopg
        from psycopg import sql

        from beamflow.postgres.sessions import ledger_spec

        seen_ms = _now_ms()
        try:
            rows = conn.execute(
                sql.SQL(
                    "SELECT kafka_partition, kafka_offset FROM {} "
                    "JOIN unnest(%s::integer[], %s::bigint[]) AS p(kp, ko) "
                    "ON kafka_partition = kp AND kafka_offset = ko"
                ).format(ledger_spec(self.config["postgres"]["sessions_table"]).qualified),
                ([s["partition"] for s in pending], [s["offset"] for s in pending]),
            ).fetchall()
        except psycopg.errors.UndefinedTable:
            return
        held = {(int(p), int(o)) for p, o in rows}
        for s in pending:
            if (s["partition"], s["offset"]) in held:
                s["sessions_ms"] = seen_ms

    def _checkpoints(self, rest: Any) -> None:
        collect_checkpoints(rest, self.job_id, self.checkpoints)

    def _vertices(self, rest: Any) -> None:
        job = rest.job(self.job_id)
        out: dict[str, dict[str, float]] = {}
        for v in job.get("vertices", []):
            rows = rest._request(
                "GET",
                f"/jobs/{self.job_id}/vertices/{v['id']}/subtasks/metrics"
                "?get=busyTimeMsPerSecond,backPressuredTimeMsPerSecond,idleTimeMsPerSecond&agg=max,avg",
            )
            metrics = {f"{r['id']}.{agg}": float(r.get(agg) or 0) for r in rows for agg in ("max", "avg")}
            for agg in ("max", "avg"):
                # Flink reports busy time as NaN for these Beam operators: it is what is neither idle nor backpressured.
                if metrics.get(f"busyTimeMsPerSecond.{agg}", 0) != metrics.get(f"busyTimeMsPerSecond.{agg}", 0):
                    metrics[f"busyTimeMsPerSecond.{agg}"] = max(
                        0.0,
                        1000
                        - metrics.get(f"idleTimeMsPerSecond.{agg}", 0)
                        - metrics.get(f"backPressuredTimeMsPerSecond.{agg}", 0),
                    )
            out[v["id"]] = metrics
        self.vertex_samples.append((time.time() - self.t0, out))


def collect_checkpoints(rest: Any, job_id: str, into: dict[int, dict[str, Any]]) -> None:
    """Adds to ``into`` each finished checkpoint of the job's history (Flink REST) not in it yet: status, duration,
    size, failure, and per vertex the slowest subtask's alignment, sync and async parts and start delay. Flink keeps
    the last ``web.checkpoints.history`` (10) only, so callers poll it every few seconds."""
    for h in rest.checkpoints(job_id).get("history", []):
        cid = int(h["id"])
        if h["status"] == "IN_PROGRESS" or cid in into:
            continue
        entry: dict[str, Any] = {
            "id": cid,
            "status": h["status"],
            "trigger_ms": h.get("trigger_timestamp"),
            "duration_ms": h.get("end_to_end_duration"),
            "size": h.get("checkpointed_size") or h.get("state_size"),
            "failure": h.get("failure_message"),
            "vertices": {},
        }
        with contextlib.suppress(Exception):
            detail = rest._request("GET", f"/jobs/{job_id}/checkpoints/details/{cid}")
            for vid, task in (detail.get("tasks") or {}).items():
                sub = rest._request("GET", f"/jobs/{job_id}/checkpoints/details/{cid}/subtasks/{vid}")
                summary = sub.get("summary") or {}
                entry["vertices"][vid] = {
                    "duration_ms": task.get("end_to_end_duration"),
                    "alignment_ms": _max_of(summary, "alignment", "duration"),
                    "sync_ms": _max_of(summary, "checkpoint_duration", "sync"),
                    "async_ms": _max_of(summary, "checkpoint_duration", "async"),
                    "start_delay_ms": (summary.get("start_delay") or {}).get("max"),
                }
        into[cid] = entry


def slowest_checkpoint_lines(checkpoints: list[dict[str, Any]], vertex_names: dict[str, str], n: int = 3) -> list[str]:
    """The ``n`` slowest checkpoints, each with its three slowest vertices' parts (max over subtasks, ms)."""
    lines = []
    for c in sorted(checkpoints, key=lambda c: -(c["duration_ms"] or 0))[:n]:
        parts = sorted(c["vertices"].items(), key=lambda kv: -(kv[1].get("duration_ms") or 0))[:3]
        lines.append(
            f"    #{c['id']} {c['status'].lower()} {c['duration_ms']} ms: "
            + "; ".join(
                f"{vertex_names.get(vid, vid)[:50]}: align {p['alignment_ms']} sync {p['sync_ms']} async "
                f"{p['async_ms']} start delay {p['start_delay_ms']}"
                for vid, p in parts
            )
        )
    return lines


def _max_of(summary: dict[str, Any], group: str, key: str) -> Any:
    return ((summary.get(group) or {}).get(key) or {}).get("max")


# ---- the variants ---------------------------------------------------------------------------------------------------


def _services() -> dict[str, Any]:
    from beamflow.services import ServiceSet

    services = ServiceSet()
    return {name: services.get(name).up() for name in ("kafka", "postgres", "registry", "flink")}


def _variant_config(name: str, states: dict[str, Any], parallelism: int) -> dict[str, Any]:
    from beamflow.config import load_config
    from beamflow.services.paths import data_dir, project_root
    from runners.flink import service_settings
    from tests.flink.drill_support import drill_config

    shipped_conf = load_config(project_root() / "conf" / "clicks.yaml")
    shipped = {k: v for k, v in shipped_conf["flink"].items() if k not in LOCAL_KEYS}
    config = drill_config(
        name,
        states["kafka"],
        states["postgres"],
        states["registry"],
        states["flink"],
        Path(data_dir()),
        **service_settings(states["flink"]),
        **{**shipped, "parallelism": parallelism},
    )
    # The job's own settings as shipped (drill_config shortens them for its drills).
    for key in ("partitions", "max_delay_ms", "idle_timeout_ms", "max_bundle_records"):
        config["kafka"][key] = shipped_conf["kafka"][key]
    config["sessions"] = dict(shipped_conf["sessions"])
    return config


def _produce_backlog(config: dict[str, Any], traffic: Any) -> dict[int, int]:
    from beamflow.kafka.admin import create_topic, produce

    kafka = config["kafka"]
    create_topic(kafka["bootstrap"], kafka["topic"], int(kafka["partitions"]))
    produce(
        kafka["bootstrap"],
        kafka["topic"],
        ((r.key, r.value, {"partition": r.partition, "timestamp_ms": r.timestamp_ms}) for r in traffic.records),
    )
    ends: dict[int, int] = Counter(r.partition for r in traffic.records)
    return {p: ends.get(p, 0) for p in range(int(kafka["partitions"]))}


def run_direct(states: dict[str, Any], traffic: Any, workdir: Path) -> dict[str, Any]:
    """The clicks job on the pinned local runner over the backlog (bounded), timed as benchmarks.e2e times it."""
    config = _variant_config("fsdirect", states, 1)
    config.pop("flink")
    config["kafka"]["bounded"] = True
    _produce_backlog(config, traffic)
    path = workdir / "direct.json"
    path.write_text(json.dumps(config))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.e2e", "--child", "beamflow", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.monotonic() - started
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"direct run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["process_wall_s"] = wall
    result["config"] = config
    return result


def _submit(config: dict[str, Any], workdir: Path, module: str = "pipelines.clicks") -> tuple[str, float]:
    """``python -m pipelines.clicks --runner=FlinkRunner`` (detached; or ``module``, a variant run the same way);
    returns the job id and the RUNNING time."""
    import yaml

    from beamflow.flink_rest import TERMINAL_STATES, FlinkRest
    from beamflow.services.paths import project_root

    name = config["job"]["name"]
    config["flink"]["job_name"] = name
    conf = workdir / f"{name}.yaml"
    conf.write_text(yaml.safe_dump(config))
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.run(
            [sys.executable, "-m", module, "--runner=FlinkRunner", f"--conf={conf}"],
            cwd=project_root(),
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
            timeout=600,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"submission of {name} failed ({proc.returncode}): {log.read_text()[-3000:]}")
    # The job server reports RUNNING (and the submitter returns) when its invocation starts, before the job graph
    # has reached Flink (seen: 16 s later): wait for the Flink job by name.
    rest = FlinkRest(config["flink"]["rest_url"])
    deadline = time.monotonic() + 300
    jobs: list[Any] = []
    while not jobs:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {name} not on the Flink cluster 300 s after its submitter returned")
        time.sleep(1)
        with contextlib.suppress(Exception):
            jobs = [j for j in rest.jobs() if j.name == name and j.state not in TERMINAL_STATES]
    job = jobs[0]
    rest.wait_for_state(job.job_id, {"RUNNING"}, timeout=120)
    running_ms = int((rest.job(job.job_id).get("timestamps") or {}).get("RUNNING") or _now_ms())
    return job.job_id, running_ms / 1000


def _combined_traffic(backlog: Any, live: LiveProducer) -> Any:
    from beamflow.generate import GeneratedTraffic

    counts: Counter[str] = Counter({k: v for k, v in backlog.counts.items() if k != "records"})
    counts.update(live.counts)
    records = [*backlog.records, *live.records]
    counts["records"] = len(records)
    return GeneratedTraffic(records=records, counts=counts)


def iceberg_first_seen(config: dict[str, Any]) -> dict[str, int]:
    """event id -> commit time (ms) of the snapshot that added the data file holding it.

    Read from the current snapshot's live manifest entries: each entry keeps the id of the snapshot that added its
    file, also after manifests were merged into a later snapshot's manifest (filtering manifests by their own
    ``added_snapshot_id`` misses those files). The sink expires old snapshots as it goes, so the snapshot that added
    an early file is often gone: then the file's modification time stands for it (the sink writes a bundle's file
    and commits it in the same flush, milliseconds apart). Taking the current snapshot's time instead, as this did
    before, dated every such file to the end of the run (catch-up 205 s by Iceberg against 118 s by the offsets).
    """
    import pyarrow.parquet as pq

    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    ice = config["iceberg"]
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"]["uri"]))
    table = catalog.load_table(ice["table"])
    committed_ms = {s.snapshot_id: s.timestamp_ms for s in table.snapshots()}
    current = table.current_snapshot()
    seen: dict[str, int] = {}
    for manifest in current.manifests(table.io) if current else []:
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            path = entry.data_file.file_path.removeprefix("file://")
            at = committed_ms.get(entry.snapshot_id or -1) or int(os.stat(path).st_mtime * 1000)
            for event_id in pq.read_table(path, columns=["event_id"])["event_id"].to_pylist():
                seen[event_id] = min(at, seen.get(event_id, at))
    return seen


def _percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50": pick(0.5), "p99": pick(0.99), "max": ordered[-1]}


def _visible_window(visible_ms: list[int]) -> tuple[float, float] | None:
    """The moments (epoch s) 10% and 90% of the backlog's events were visible in Iceberg."""
    if len(visible_ms) < 10:
        return None
    ordered = sorted(visible_ms)
    lo, hi = ordered[int(0.1 * len(ordered))], ordered[int(0.9 * len(ordered)) - 1]
    return (lo / 1000, hi / 1000) if hi > lo else None


def _visible_sustained(visible_ms: list[int], total_records: int) -> float | None:
    """Records/s between the moments 10% and 90% of the backlog's events were visible in Iceberg, scaled from events
    to backlog records. The sink commits once per bundle (about once a second per subtask), so this slope has about a
    second's resolution, against a checkpoint interval's for the committed offsets."""
    window = _visible_window(visible_ms)
    if window is None:
        return None
    events = int(0.9 * len(visible_ms)) - 1 - int(0.1 * len(visible_ms))
    return events / (window[1] - window[0]) * total_records / len(visible_ms)


def _sessions_line(metrics: dict[str, Any]) -> str:
    """The sessions store's work per 1,000 records read, from Beam's counters (summed over subtasks)."""

    def total(name: str) -> float:
        # Exact ends: the read also counts per partition (records_read.<topic>-<partition>).
        return sum(v for k, v in metrics.items() if k.endswith(name) and isinstance(v, int | float))

    read = total("records_read")
    if not read:
        return ""
    inserted, replaced = total("rows_inserted"), total("rows_replaced")
    return (
        f"\n  sessions store per 1,000 records read (Beam counters at the catch-up, {read:,.0f} read): "
        f"{1000 * inserted / read:.0f} rows inserted, {1000 * replaced / read:.0f} replaced"
    )


def _busy_cores(samples: list[tuple[float, float]], window: tuple[float, float] | None) -> float | None:
    """The machine's busy cores between two moments, from the per-second samples nearest inside them. The catch-up's
    average understates the steady phase: its start (deploying) and its tail (one partition left) leave cores idle."""
    if window is None:
        return None
    inside = [(t, b) for t, b in samples if window[0] <= t <= window[1]]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def _sustained(offsets: list[tuple[float, int, int]], total: int, since: float) -> float | None:
    """Records/s between the samples where 10% and 90% of ``total`` were committed (committed offsets move in steps,
    one per checkpoint, so the span covers several checkpoints)."""
    pts = [(t, c) for t, c, _ in offsets if t >= since]
    lo = next(((t, c) for t, c in pts if c >= 0.1 * total), None)
    hi = next(((t, c) for t, c in pts if c >= 0.9 * total), None)
    if not lo or not hi or hi[0] <= lo[0]:
        return None
    return (hi[1] - lo[1]) / (hi[0] - lo[0])


def run_streaming(
    label: str, parallelism: int, states: dict[str, Any], backlog: Any, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    from beamflow.flink_rest import FlinkRest
    from tests.flink.drill_support import check_exactly_once, committed_offsets
    from tests.flink.test_streaming_backlog import overlapping_sessions, session_events

    config = _variant_config(f"fs{label}", states, parallelism)
    config["flink"].update(args.flink_overrides)
    for section, values in args.job_overrides.items():
        config.setdefault(section, {}).update(values)
    config["postgres"]["first_copies_table"] = f"first_copies_{config['job']['name']}"
    backlog_end = _produce_backlog(config, backlog)
    rest = FlinkRest(config["flink"]["rest_url"])
    roots = {
        "taskmanagers": [pid for role, pid in states["flink"].info["roles"].items() if role.startswith("taskmanager")],
        "jobmanager": [states["flink"].info["roles"]["jobmanager"]],
        "job_server": [states["flink"].info["roles"]["job_server"]],
        "kafka": list(states["kafka"].pids),
        "postgres": list(states["postgres"].pids),
        "registry": list(states["registry"].pids),
    }
    live = LiveProducer(config, args.live_rate, backlog_end, seed=1000 * parallelism)
    out: dict[str, Any] = {"label": label, "parallelism": parallelism, "backlog_end": backlog_end}
    submit_start = time.time()
    live.start()  # live traffic from the submission on
    job_id, running_at = _submit(config, workdir)
    out.update(job_id=job_id, submit_s=running_at - submit_start, running_at=running_at)
    sampler = Sampler(config, job_id, backlog_end, live)
    sampler.t0 = running_at
    sampler.expected_pg = int(backlog.counts["duplicate_sends"] + backlog.counts["bad_records"])
    cpu_start = cpu_by_role(roots)
    busy_start = machine_busy_s()
    sampler.start()
    deadline = time.monotonic() + args.timeout
    try:
        while sampler.committed_at_end is None or sampler.pg_backlog_at is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: not caught up after {args.timeout}s ({sampler.offsets[-1:]})")
            if rest.job_state(job_id) != "RUNNING":
                raise RuntimeError(f"{label}: job {job_id} is {rest.job_state(job_id)}")
            time.sleep(1)
        cpu_caught = cpu_by_role(roots)
        busy_caught = machine_busy_s()
        caught_wall = time.time()
        try:
            # Beam's counters at the catch-up (summed over subtasks): what the sinks did per record read.
            from beamflow.cli.status import beam_metrics

            out["beam_metrics"] = beam_metrics(rest, job_id)[0]
        except Exception as exc:  # a figure for the report, never a reason to lose the run
            out["beam_metrics"] = {"error": str(exc)[:200]}
        out["cpu_s"] = {k: round(cpu_caught.get(k, 0) - cpu_start.get(k, 0), 1) for k in cpu_caught}
        out["machine_busy_s"] = round(busy_caught - busy_start, 1)
        out["machine_wall_s"] = round(time.time() - running_at, 1)
        # The live traffic produced during the catch-up is still ahead of the job: the steady state starts once the
        # lag is down to what the live rate leaves between two commits of the group's offsets (they move once per
        # checkpoint, so up to two intervals of live records), not at the backlog's end.
        keeping_up = args.live_rate * 2 * config["flink"]["checkpointing_interval_ms"] / 1000
        out["live_caught_up_s"] = None
        while out["live_caught_up_s"] is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: lag never fell to {keeping_up:,.0f} ({sampler.offsets[-1:]})")
            if rest.job_state(job_id) != "RUNNING":
                raise RuntimeError(f"{label}: job {job_id} is {rest.job_state(job_id)}")
            at, committed, end = sampler.offsets[-1]
            if end - committed <= keeping_up:
                out["live_caught_up_s"] = at
            time.sleep(1)
        time.sleep(args.steady_s)
        live.stop()
        if live.error:
            raise RuntimeError(f"{label}: live producer failed: {live.error}")
        # Everything produced ends in the sinks and the group's offsets reach the end.
        final_end = live.next_offsets
        while committed_offsets(config) != final_end:
            if time.monotonic() > deadline + 300:
                raise RuntimeError(f"{label}: committed offsets did not reach {final_end}")
            time.sleep(2)
        time.sleep(2)  # one more sessions poll
    finally:
        live.stop()
        sampler.stop()
        out["checkpoint_counts"] = rest.checkpoints(job_id).get("counts")
        out["exceptions"] = len(rest.failure_history(job_id))
        job = rest.job(job_id)
        out["vertex_names"] = {v["id"]: v.get("name", "")[:160] for v in job.get("vertices", [])}
        out["vertex_parallelism"] = {v["id"]: v.get("parallelism") for v in job.get("vertices", [])}
        with contextlib.suppress(Exception):
            rest.cancel(job_id)
            rest.wait_for_state(job_id, {"CANCELED"}, timeout=60)
    # Catch-up: every backlog record in its sink (Iceberg: the last backlog event's first snapshot; PostgreSQL sinks:
    # polled) and the committed offsets at the backlog's end.
    first_seen = iceberg_first_seen(config)
    from beamflow.event_id import event_id_from_fields
    from beamflow.generate import EVENT_ID_FIELDS

    backlog_ids = [event_id_from_fields(r.event, EVENT_ID_FIELDS) for r in backlog.records if r.kind == "event"]
    backlog_visible_ms = [first_seen[i] for i in backlog_ids if i in first_seen]
    missing = len(backlog_ids) - len(backlog_visible_ms)
    iceberg_at = max(backlog_visible_ms, default=0) / 1000 - running_at
    caught = max(sampler.committed_at_end or 0, sampler.pg_backlog_at or 0, iceberg_at)
    total_backlog = sum(backlog_end.values())
    committed_at_catch_up = next((c for t, c, _ in sampler.offsets if t >= caught), sampler.offsets[-1][1])
    out.update(
        catch_up_s=caught,
        catch_up_parts={
            "committed_offsets_s": sampler.committed_at_end,
            "iceberg_last_backlog_event_s": iceberg_at,
            "postgres_sinks_s": sampler.pg_backlog_at,
        },
        backlog_records=total_backlog,
        rate_over_catch_up=committed_at_catch_up / caught,
        backlog_rate=total_backlog / caught,
        sustained=_sustained(sampler.offsets, total_backlog, 0.0) or committed_at_catch_up / caught,
        visible_sustained=_visible_sustained(backlog_visible_ms, total_backlog),
        visible_window_busy_cores=_busy_cores(sampler.busy, _visible_window(backlog_visible_ms)),
        offsets=sampler.offsets,
        sampler_errors=sampler.errors[:20],
        iceberg_missing_backlog=missing,
        caught_wall=caught_wall,
    )
    # Latency from produce to visible, live events only: all of them (Iceberg), the sampled ones (sessions); those
    # produced once the job kept up with live traffic (after the backlog and the live records that piled up meanwhile)
    # are the steady state.
    caught_abs_ms = (running_at + max(caught, out["live_caught_up_s"])) * 1000
    ice_all, ice_steady, ice_missing = [], [], 0
    for r, sent in zip(live.records, live.sent_ms, strict=True):
        if r.kind != "event":
            continue
        seen = first_seen.get(event_id_from_fields(r.event, EVENT_ID_FIELDS))
        if seen is None:
            ice_missing += 1
            continue
        ice_all.append((seen - sent) / 1000)
        if sent >= caught_abs_ms:
            ice_steady.append((seen - sent) / 1000)
    ses_all = [(s["sessions_ms"] - s["sent_ms"]) / 1000 for s in live.samples if s["sessions_ms"]]
    ses_steady = [
        (s["sessions_ms"] - s["sent_ms"]) / 1000
        for s in live.samples
        if s["sessions_ms"] and s["sent_ms"] >= caught_abs_ms
    ]
    out["latency"] = {
        "iceberg_all": _percentiles(ice_all),
        "iceberg_steady": _percentiles(ice_steady),
        "iceberg_not_found": ice_missing,
        "sessions_all": _percentiles(ses_all),
        "sessions_steady": _percentiles(ses_steady),
        "sessions_not_found": sum(1 for s in live.samples if not s["sessions_ms"]),
    }
    out["live"] = {"records": len(live.records), "counts": dict(live.counts), "rate": args.live_rate}
    out["checkpoints"] = [sampler.checkpoints[k] for k in sorted(sampler.checkpoints)]
    out["vertex_load"] = _vertex_load(sampler.vertex_samples, caught)
    traffic = _combined_traffic(backlog, live)
    out["expected"] = {k: int(traffic.counts[k]) for k in ("events", "duplicate_sends", "bad_records", "records")}
    problems = check_exactly_once(config, traffic)
    try:
        out["event_level_audit"] = event_level_audit(config, traffic) if problems else []
    except Exception as exc:  # the strict audit above stands either way
        out["event_level_audit"] = [f"not computed: {type(exc).__name__}: {exc}"]
    overlaps = overlapping_sessions(config)
    if overlaps:
        problems.append(f"{overlaps} pairs of overlapping sessions")
    events_in_sessions = session_events(config)
    if not 0 < events_in_sessions <= traffic.counts["events"]:
        problems.append(f"sessions count {events_in_sessions} events of {traffic.counts['events']}")
    out["session_events"] = events_in_sessions
    out["problems"] = problems
    return out


def warm_up(args: argparse.Namespace, states: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One untimed job at the list's highest parallelism on a short backlog of its own (audited like the others).

    The cluster, the broker and the registry are usually started for the run: their JVMs first interpret, then
    compile, and the first job on a TaskManager also loads the runner's classes. A round that ran first once spent
    2.5-5x the TaskManagers' CPU seconds of the later rounds and kept p1 at 1.36 busy cores, which leaves p2 / p1 at
    most 1.47 on 2 cores: a figure of the start, not of the job. A deployment runs for hours on warm JVMs.
    """
    from beamflow.generate import TrafficSpec, avro_click_encoder, generate_traffic

    spec = TrafficSpec(events=args.warmup_events, duplicate_share=0.05, seed=8)
    traffic = generate_traffic(spec, avro_click_encoder(states["registry"].info["url"], "flink-streaming-bench-value"))
    parallelism = max(int(x) for x in args.parallelism.split(","))
    short = argparse.Namespace(**{**vars(args), "steady_s": 10.0})
    started = time.monotonic()
    v = run_streaming("warm", parallelism, states, traffic, short, workdir)
    summary = {
        "parallelism": parallelism,
        "events": args.warmup_events,
        "wall_s": round(time.monotonic() - started, 1),
        "catch_up_s": round(v["catch_up_s"], 1),
        "cpu_s": v["cpu_s"],
        "problems": v["problems"],
    }
    print(
        f"warm-up (untimed, p{parallelism}, {args.warmup_events:,} events): {summary['wall_s']:.0f}s, caught up in "
        f"{summary['catch_up_s']:.0f}s, CPU s {summary['cpu_s']}, audit {v['problems'] or 'OK'}",
        flush=True,
    )
    return summary


def event_level_audit(config: dict[str, Any], traffic: Any) -> list[str]:
    """The audit by event id instead of by Kafka coordinates: each event's id once in Iceberg (from either of its
    copies), every other copy of it quarantined, nothing else there. check_exactly_once also requires the kept copy to
    be the lower offset; this tells a different choice of copy apart from a lost or doubled event."""
    from beamflow.event_id import event_id_from_fields
    from beamflow.generate import EVENT_ID_FIELDS
    from tests.flink.drill_support import accounted_offsets

    next_offset: dict[int, int] = defaultdict(int)
    id_at: dict[tuple[int, int], str] = {}
    copies: Counter[str] = Counter()
    for r in traffic.records:
        coordinate = (r.partition, next_offset[r.partition])
        next_offset[r.partition] += 1
        if r.kind in ("event", "duplicate") and r.event is not None:
            event_id = event_id_from_fields(r.event, EVENT_ID_FIELDS)
            id_at[coordinate] = event_id
            copies[event_id] += 1
    held = accounted_offsets(config)
    iceberg = Counter(id_at.get(tuple(c), "?") for c in held["iceberg"])
    quarantined = Counter(id_at.get(tuple(c), "?") for c in held["quarantine"])
    problems = []
    if set(iceberg) != set(copies) or any(n != 1 for n in iceberg.values()):
        problems.append(f"iceberg ids: {len(iceberg)} distinct, {sum(iceberg.values())} rows, {len(copies)} events")
    if any(quarantined[i] != copies[i] - 1 for i in copies) or "?" in quarantined:
        problems.append("quarantine does not hold exactly the other copies of each id")
    return problems


def _vertex_load(samples: list[tuple[float, dict[str, dict[str, float]]]], until: float) -> dict[str, dict[str, float]]:
    """Per vertex, the mean over the catch-up of each metric (avg and max over subtasks)."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for at, per_vertex in samples:
        if at > until:
            continue
        for vid, metrics in per_vertex.items():
            for k, v in metrics.items():
                acc[vid][k].append(v)
    return {vid: {k: round(statistics.fmean(v), 1) for k, v in m.items()} for vid, m in acc.items()}


# ---- report -------------------------------------------------------------------------------------------------------


def _goal_line(name: str, value: float | None, goal: float, higher_is_better: bool, what: str) -> str:
    if value is None:
        return f"  {name}: not measured ({what})"
    met = value >= goal if higher_is_better else value <= goal
    by = value / goal
    return (
        f"  {name} = {value:.2f} (goal {'>=' if higher_is_better else '<='} {goal}): "
        f"{'MET' if met else 'MISSED'} ({by:.2f}x the goal; {what})"
    )


def report(figures: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    direct = figures.get("direct")
    interval_s = figures["interval_ms"] / 1000
    if figures.get("flink_overrides"):
        lines.append(f"flink: settings changed from conf/flink.yaml for this run: {figures['flink_overrides']}")
    if figures.get("job_overrides"):
        lines.append(f"job settings changed from conf/clicks.yaml for this run: {figures['job_overrides']}")
    if direct:
        lines.append(
            f"direct (pinned local runner, bounded): {direct['records']:,} records in {direct['seconds']:.1f}s "
            f"(run_with_config; process {direct['process_wall_s']:.1f}s) = {direct['records'] / direct['seconds']:,.0f}"
            f" records/s, CPU {direct['cpu_s']:.1f}s; audit {direct.get('audit_problems') or 'OK'}"
        )
    for v in figures["streaming"]:
        lat = v["latency"]
        cps = [c for c in v["checkpoints"] if c["status"] == "COMPLETED"]
        durations = [c["duration_ms"] / 1000 for c in cps]
        # Flink's failed count includes triggers refused while the tasks were still deploying: those never started,
        # so they have no history entry (tests/flink/test_streaming_backlog.py); every started one was sampled.
        started_failed = sum(1 for c in v["checkpoints"] if c["status"] == "FAILED")
        refused = max(int((v["checkpoint_counts"] or {}).get("failed", 0)) - started_failed, 0)
        lines.append(
            f"\n{v['label']} (parallelism {v['parallelism']}): submission {v['submit_s']:.1f}s; caught up "
            f"{v['catch_up_s']:.1f}s after RUNNING ({v['backlog_records']:,} backlog records; committed offsets "
            f"{v['catch_up_parts']['committed_offsets_s']:.1f}s, last backlog event in Iceberg "
            f"{v['catch_up_parts']['iceberg_last_backlog_event_s']:.1f}s, PostgreSQL sinks "
            f"{v['catch_up_parts']['postgres_sinks_s']:.1f}s); kept up with live traffic (lag within two "
            f"intervals of it) {v['live_caught_up_s']:.1f}s after RUNNING\n"
            f"  records/s: sustained (10%->90% of the backlog committed) "
            + (f"{v['sustained']:,.0f}" if v["sustained"] else "?")
            + "; by Iceberg visibility (10%->90% of the backlog's events) "
            + (f"{v['visible_sustained']:,.0f}" if v.get("visible_sustained") else "?")
            + f"; over the whole catch-up {v['rate_over_catch_up']:,.0f} (consumed incl. live), backlog/catch-up "
            f"{v['backlog_rate']:,.0f}; live {v['live']['rate']}/s, {v['live']['records']:,} live records\n"
            f"  checkpoints: {len(cps)} completed, {started_failed} failed after starting, {refused} refused while "
            f"the tasks deployed (counts {v['checkpoint_counts']}); duration s p50 "
            f"{statistics.median(durations) if durations else 0:.1f} max {max(durations, default=0):.1f} (interval "
            f"{interval_s:.0f}s); restarts/exceptions {v['exceptions']}\n"
            f"  latency produce -> Iceberg (all live events) p50 {lat['iceberg_all']['p50']} p99 "
            f"{lat['iceberg_all']['p99']} s; keeping up p50 {lat['iceberg_steady']['p50']} p99 "
            f"{lat['iceberg_steady']['p99']} s (n={lat['iceberg_steady']['n']}); not found {lat['iceberg_not_found']}\n"
            f"  latency produce -> sessions (1 in {SAMPLE_EVERY}, polled ~2 s) p50 {lat['sessions_all']['p50']} p99 "
            f"{lat['sessions_all']['p99']} s; keeping up p50 {lat['sessions_steady']['p50']} p99 "
            f"{lat['sessions_steady']['p99']} s (n={lat['sessions_steady']['n']}); "
            f"not found {lat['sessions_not_found']}"
            f"\n  CPU s during the catch-up: {v['cpu_s']}"
            + (
                f"\n  machine busy {v['machine_busy_s']:.0f} CPU s in {v['machine_wall_s']:.0f} s: "
                f"{v['machine_busy_s'] / v['machine_wall_s']:.2f} of {figures['nproc']} cores"
                if v.get("machine_wall_s")
                else ""
            )
            + (
                f"; between 10% and 90% of the backlog visible in Iceberg {v['visible_window_busy_cores']:.2f}"
                if v.get("visible_window_busy_cores")
                else ""
            )
            + _sessions_line(v.get("beam_metrics", {}))
        )
        lines.append("  slowest checkpoint parts (max over subtasks, per vertex; ms):")
        lines += slowest_checkpoint_lines(cps, v["vertex_names"])
        lines.append("  busy / backpressured ms per s during the catch-up (avg over subtasks, max):")
        for vid, m in sorted(v["vertex_load"].items(), key=lambda kv: -kv[1].get("busyTimeMsPerSecond.avg", 0)):
            lines.append(
                f"    busy {m.get('busyTimeMsPerSecond.avg', 0):5.0f} ({m.get('busyTimeMsPerSecond.max', 0):4.0f}) "
                f"backpressured {m.get('backPressuredTimeMsPerSecond.avg', 0):5.0f} "
                f"({m.get('backPressuredTimeMsPerSecond.max', 0):4.0f})  x{v['vertex_parallelism'].get(vid)} "
                f"{v['vertex_names'].get(vid, vid)[:110]}"
            )
        if v["problems"]:
            lines.append(
                "  audit by event id (either copy of an id may be the one kept): "
                + ("; ".join(v["event_level_audit"]) or "OK: every event once in Iceberg, its other copies quarantined")
            )
        lines.append(
            f"  audit: {'; '.join(v['problems']) if v['problems'] else 'OK'} (expected {v['expected']}, "
            f"session events {v['session_events']:,})"
        )
    by = {v["label"]: v for v in figures["streaming"]}
    p1, p2 = by.get("p1"), by.get("p2")
    ratios: dict[str, float | None] = {}
    if p1 and p2 and p1["sustained"] and p2["sustained"]:
        ratios["p2_over_p1"] = p2["sustained"] / p1["sustained"]
    if p1 and p1["sustained"] and direct:
        ratios["p1_over_direct"] = p1["sustained"] / (direct["records"] / direct["seconds"])
    if p1 and p2 and p1.get("visible_sustained") and p2.get("visible_sustained"):
        ratios["p2_over_p1_visible"] = p2["visible_sustained"] / p1["visible_sustained"]
    if p1 and p1.get("visible_sustained") and direct:
        ratios["p1_over_direct_visible"] = p1["visible_sustained"] / (direct["records"] / direct["seconds"])
    if p1 and p1.get("machine_wall_s"):
        # What this machine leaves p2: if p1 already keeps c of its n cores busy, p2 can at best go n / c times as
        # fast, however well the job scales (the broker, PostgreSQL and the JobManager share the same cores).
        ratios["p2_over_p1_cpu_ceiling"] = figures["nproc"] / (p1["machine_busy_s"] / p1["machine_wall_s"])
    if p1 and p1.get("visible_window_busy_cores"):
        # The same over the span the Iceberg measure spans (the steady phase): the ceiling for that measure.
        ratios["p2_over_p1_cpu_ceiling_visible"] = figures["nproc"] / p1["visible_window_busy_cores"]
    all_cps = [c["duration_ms"] for v in figures["streaming"] for c in v["checkpoints"] if c["status"] == "COMPLETED"]
    if all_cps:
        ratios["checkpoint_over_interval"] = max(all_cps) / figures["interval_ms"]
    steady_p99 = [v["latency"]["iceberg_steady"]["p99"] for v in figures["streaming"]]
    if steady_p99 and all(x is not None for x in steady_p99):
        ratios["iceberg_p99_over_2x_interval"] = max(steady_p99) / (2 * interval_s)
    figures["ratios"] = ratios
    lines.append("\nratios (measured in this run):")
    lines.append(_goal_line("p2 / p1 sustained records/s", ratios.get("p2_over_p1"), 1.7, True, "p1 and p2 needed"))
    lines.append(
        _goal_line("  the same by Iceberg visibility", ratios.get("p2_over_p1_visible"), 1.7, True, "p1 and p2 needed")
    )
    if ratios.get("p2_over_p1_cpu_ceiling"):
        lines.append(
            f"  (this machine's ceiling for it: {figures['nproc']} cores / the cores busy during p1's catch-up = "
            f"{ratios['p2_over_p1_cpu_ceiling']:.2f})"
        )
    if p1 and ratios.get("p2_over_p1_cpu_ceiling_visible"):
        busy_p2 = p2.get("visible_window_busy_cores") if p2 else None
        lines.append(
            f"  (the same between 10% and 90% visible, the span the Iceberg measure covers: {figures['nproc']} cores / "
            f"p1's {p1['visible_window_busy_cores']:.2f} busy = {ratios['p2_over_p1_cpu_ceiling_visible']:.2f}"
            + (f"; p2 kept {busy_p2:.2f} of {figures['nproc']} busy over its own span)" if busy_p2 else ")")
        )
    lines.append(
        _goal_line(
            "p1 streaming sustained / DirectRunner records/s", ratios.get("p1_over_direct"), 0.5, True, "direct needed"
        )
    )
    lines.append(
        _goal_line("  the same by Iceberg visibility", ratios.get("p1_over_direct_visible"), 0.5, True, "direct needed")
    )
    lines.append(
        _goal_line("max checkpoint duration / interval", ratios.get("checkpoint_over_interval"), 1.0, False, "all")
    )
    lines.append(
        _goal_line(
            "produce->Iceberg p99 keeping up / (2 x interval)",
            ratios.get("iceberg_p99_over_2x_interval"),
            1.0,
            False,
            "worst variant",
        )
    )
    return lines


def rounds_report(per_round: list[dict[str, float | None]]) -> list[str]:
    """Each round's p2 / p1 (its two variants run minutes apart), their median and how many rounds met the goal."""
    lines = ["\nper round (p1 and p2 of a round run back to back):"]
    for key, what in (("p2_over_p1", "by committed offsets"), ("p2_over_p1_visible", "by Iceberg visibility")):
        found = [ratios.get(key) for ratios in per_round]
        values = [x for x in found if x is not None]
        if not values:
            continue
        lines.append(
            f"  p2 / p1 {what}: "
            + ", ".join(f"{x:.2f}" if x is not None else "?" for x in found)
            + f"; median {statistics.median(values):.2f}; goal 1.7 met in {sum(x >= 1.7 for x in values)} of "
            f"{len(values)} rounds"
        )
    return lines


def plot(figures: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lag_ax, cp_ax) = plt.subplots(2, 1, figsize=(12, 9))
    interval_s = figures["interval_ms"] / 1000
    for v in figures["streaming"]:
        xs = [t for t, _, _ in v["offsets"]]
        ys = [end - c for _, c, end in v["offsets"]]
        (line,) = lag_ax.plot(xs, ys, drawstyle="steps-post", label=f"{v['label']} (parallelism {v['parallelism']})")
        lag_ax.axvline(v["catch_up_s"], color=line.get_color(), ls=":", lw=1)
        cps = [c for c in v["checkpoints"] if c["status"] == "COMPLETED" and c["trigger_ms"]]
        cp_x = [c["trigger_ms"] / 1000 - v["running_at"] for c in cps]
        cp_ax.plot(cp_x, [c["duration_ms"] / 1000 for c in cps], "o-", color=line.get_color(), label=v["label"])
        failed = [c for c in v["checkpoints"] if c["status"] != "COMPLETED" and c["trigger_ms"]]
        if failed:
            cp_ax.plot([c["trigger_ms"] / 1000 - v["running_at"] for c in failed], [0] * len(failed), "x", color="red")
        cp_ax.axvline(v["catch_up_s"], color=line.get_color(), ls=":", lw=1)
    lag_ax.set_ylabel("consumer lag (end offsets - committed)")
    lag_ax.set_xlabel("seconds since the job was RUNNING (dotted: caught up)")
    lag_ax.set_title(
        f"{figures['backlog_records']:,}-record backlog + live {figures['live_rate']}/s, conf/flink.yaml as shipped",
        fontsize=10,
    )
    lag_ax.grid(alpha=0.3)
    lag_ax.legend(fontsize=8)
    cp_ax.axhline(interval_s, color="gray", ls="--", lw=1, label=f"interval {interval_s:.0f}s")
    cp_ax.set_ylabel("checkpoint end-to-end duration (s)")
    cp_ax.set_xlabel("checkpoint trigger, seconds since the job was RUNNING (x: failed)")
    cp_ax.grid(alpha=0.3)
    cp_ax.legend(fontsize=8)
    fig.suptitle(f"clicks job streaming on Flink (nproc={figures['nproc']})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _settings(pairs: list[str], flag: str) -> Iterator[tuple[str, Any]]:
    """``KEY=VALUE`` pairs as (key, value), each value read as YAML (``3000`` is an int, ``true`` a bool)."""
    import yaml

    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} takes KEY=VALUE, not {pair!r}")
        yield key, yaml.safe_load(value)


def _job_overrides(pairs: list[str]) -> dict[str, dict[str, Any]]:
    """``SECTION.KEY=VALUE`` pairs as settings of the job's other sections (``kafka.max_bundle_records=5000``)."""
    overrides: dict[str, dict[str, Any]] = {}
    for dotted, value in _settings(pairs, "--job-set"):
        section, dot, key = dotted.partition(".")
        if not dot or not key or section == "flink":
            raise SystemExit(f"--job-set takes SECTION.KEY=VALUE (not flink.*: --flink-set), not {dotted!r}")
        overrides.setdefault(section, {})[key] = value
    return overrides


def _flink_overrides(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as flink: settings."""
    return {key.removeprefix("flink."): value for key, value in _settings(pairs, "--flink-set")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="backlog events (plus duplicates and bad records)")
    parser.add_argument("--live-rate", type=float, default=500, help="live records/s produced while the job runs")
    parser.add_argument("--parallelism", default="1,2")
    parser.add_argument("--steady-s", type=float, default=60, help="live traffic goes on this long after catch-up")
    parser.add_argument("--timeout", type=float, default=2400, help="seconds a variant may take to catch up")
    parser.add_argument("--no-direct", action="store_true", help="skip the DirectRunner baseline")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the parallelism list this many times, interleaved (p1, p2, p1, p2, ...): each round's own p2 / p1 "
        "and their median are printed, as the pace of a shared machine drifts between runs",
    )
    parser.add_argument(
        "--warmup-events",
        type=int,
        default=20_000,
        help="first run one untimed job on a backlog this long at the list's highest parallelism, so no timed round "
        "pays the just-started JVMs' warm-up (0: none)",
    )
    parser.add_argument(
        "--flink-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one flink: setting of the streaming variants (e.g. max_bundle_size=3000); repeatable",
    )
    parser.add_argument(
        "--job-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting of the streaming variants' job (e.g. kafka.max_bundle_records=5000); repeatable",
    )
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--plot", help="write the PNG here")
    args = parser.parse_args(argv)
    args.flink_overrides = _flink_overrides(args.flink_set)
    args.job_overrides = _job_overrides(args.job_set)

    from beamflow.config import load_config
    from beamflow.generate import TrafficSpec, avro_click_encoder, generate_traffic
    from beamflow.services.paths import data_dir, project_root

    workdir = Path(data_dir()) / "flink_streaming" / uuid.uuid4().hex[:6]
    workdir.mkdir(parents=True, exist_ok=True)
    states = _services()
    shipped = load_config(project_root() / "conf" / "clicks.yaml")["flink"]
    registry = states["registry"].info["url"]
    spec = TrafficSpec(events=args.events, duplicate_share=0.05)
    started = time.monotonic()
    # One subject for every variant's topic (drill_config names a subject per run): encode with the first one's.
    backlog = generate_traffic(spec, avro_click_encoder(registry, "flink-streaming-bench-value"))
    print(
        f"backlog {backlog.summary()} generated in {time.monotonic() - started:.0f}s; nproc={os.cpu_count()}, "
        f"load average {os.getloadavg()[0]:.1f}; workdir {workdir}",
        flush=True,
    )
    figures: dict[str, Any] = {
        "events": args.events,
        "live_rate": args.live_rate,
        "backlog_records": len(backlog.records),
        "nproc": os.cpu_count(),
        "load_at_start": os.getloadavg(),
        "interval_ms": int(args.flink_overrides.get("checkpointing_interval_ms", shipped["checkpointing_interval_ms"])),
        "shipped_flink": {k: v for k, v in shipped.items() if k not in LOCAL_KEYS},
        "flink_overrides": args.flink_overrides,
        "job_overrides": args.job_overrides,
        "streaming": [],
    }
    problems: dict[str, list[str]] = {}
    if not args.no_direct:
        from benchmarks.e2e import audit

        direct = run_direct(states, backlog, workdir)
        expected = {k: int(backlog.counts[k]) for k in ("events", "duplicate_sends", "bad_records")}
        a = audit(direct.pop("config"), expected)
        direct["audit_problems"] = a["problems"]
        direct["load"] = os.getloadavg()[0]
        figures["direct"] = direct
        if a["problems"]:
            problems["direct"] = a["problems"]
        print(f"direct done: {direct['seconds']:.1f}s, audit {a['problems'] or 'OK'}", flush=True)
    if args.warmup_events > 0:
        figures["warmup"] = warm_up(args, states, workdir)
        if figures["warmup"]["problems"]:
            problems["warm-up"] = figures["warmup"]["problems"]
    rounds: list[list[dict[str, Any]]] = []
    for r in range(1, args.rounds + 1):
        variants = []
        for p in (int(x) for x in args.parallelism.split(",")):
            v = run_streaming(f"p{p}", p, states, backlog, args, workdir)
            (workdir / f"p{p}-round{r}.json").write_text(json.dumps(v, default=str))
            v["load"] = os.getloadavg()[0]
            v["round"] = r
            variants.append(v)
            if v["problems"]:
                problems[f"{v['label']} round {r}"] = v["problems"]
            print(
                f"p{p} round {r} done: caught up in {v['catch_up_s']:.0f}s, audit {v['problems'] or 'OK'}", flush=True
            )
        rounds.append(variants)
    figures["load_at_end"] = os.getloadavg()
    figures["rounds"] = []
    for r, variants in enumerate(rounds, 1):
        # Each round reported in full against the same DirectRunner figure; the last round's variants are the ones
        # plotted.
        figures["streaming"] = variants
        if len(rounds) > 1:
            print(f"\n===== round {r} of {len(rounds)} =====")
        for line in report(figures):
            print(line)
        figures["rounds"].append({"ratios": figures["ratios"], "variants": variants})
    if len(rounds) > 1:
        for line in rounds_report([entry["ratios"] for entry in figures["rounds"]]):
            print(line)
    for name, found in problems.items():
        print(f"AUDIT PROBLEM ({name}): {'; '.join(found)}")
    print("\nrun INVALID: an audit failed" if problems else "\naudit: every variant clean; the run is valid")
    figures["problems"] = problems
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))
    if args.plot:
        plot(figures, args.plot)
        print(f"plot written to {args.plot}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
