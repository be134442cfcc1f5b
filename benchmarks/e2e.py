"""The clicks job against a hand-written single-process baseline doing the same work, same data, same run.

    .venv/bin/python -m benchmarks.e2e [--events 5000] [--json .data/bench/e2e.json] [--plot docs/benchmarks.png]

One topic is filled once with ``beamflow.generate`` traffic (skew, duplicate sends, late events, bad records, schema
v2). Each variant then reads all of it from the start, in its own subprocess (so peak RSS is its own), with its own
consumer group, PostgreSQL tables and Iceberg table:

- ``baseline``: a confluent-kafka consumer loop; Avro decode through the registry; event id from the identifying
  fields; dedup in a dict; one Iceberg append (plain pyiceberg) per commit interval and at the end; sessions (10-minute
  gap) per user computed in memory; sessions, duplicates and dead letters COPYed into PostgreSQL; offsets committed at
  the end. No exactly-once bookkeeping, no late panes, no replay safety: the floor of the work, not a product.
- ``beamflow``: ``pipelines.clicks`` on the pinned local runner (FnApiRunner), exactly as ``beamflow demo`` runs it.
- ``beamflow-head``: the same job with the committed (``git show HEAD:...``) versions of ``HEAD_FILES`` loaded in
  place of the working tree's, so a change to those transforms is measured before/after in one run.
- ``beamflow-nocache`` (not run by default): the SDK worker's state cache disabled; ``runners/direct.py`` now does
  that itself, so it measures the same code as ``beamflow`` (see docs/benchmarks.md).
- ``flink``: the same job, ``run_with_config(config, runner="FlinkRunner")``, on the local Flink session cluster that
  ``FlinkService`` starts under the same data folder (Beam's job server, LOOPBACK SDK workers in the variant's
  subprocess, the job server's jars staged as ``runners.flink.options_for_service`` does), in **batch** mode
  (``streaming: false``), parallelism 1 (see ``FLINK_BENCH`` for both). Its figures come in three parts:
  *submission* (``run_with_config`` called -> the Flink job's ``start-time``: pipeline construction, the job server's
  translation and the upload of about 100 MB of jars), the *job run* (``start-time`` -> ``end-time`` of
  ``/jobs/<id>``, as Flink records it), and the *total wall* of ``run_with_config``. Its throughput is given over the
  job run and over the total wall. Peak RSS is the submitting process's (pipeline construction plus the LOOPBACK
  Python workers); the Flink JVMs are not in it: their CPU seconds (``/proc/<pid>/stat`` before and after) and the
  TaskManager's RSS and heap (sampled every 0.5 s from ``/proc`` and Flink REST) are printed beside it.

While the beamflow variants run, a thread samples the group's committed offsets against the end offsets (consumer
lag over time). Printed: wall seconds, records/s, CPU seconds (user+sys of the subprocess), peak RSS, the ratios to the
baseline, and for beamflow the wall time per fused stage (FnApiRunner bundles timed from outside). After every variant
its sinks are audited: Iceberg rows and distinct event ids = produced events, quarantined rows = duplicate sends, dead
letters = bad records, sessions = the baseline's (and no session key twice), and the group's committed offsets = the
topic's end offsets on every partition.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

VARIANTS = ("baseline", "beamflow-head", "beamflow", "flink")
# What the ``beamflow-head`` variant takes from git HEAD instead of the working tree.
HEAD_FILES = ("transforms/deduplicate.py", "transforms/hot_key_aggregate.py")
GOAL = 0.5
# The baseline appends to Iceberg at most this often (the issue: "one Iceberg append per interval").
BASELINE_APPEND_INTERVAL_S = 5.0
# The ``flink`` variant's settings over conf/flink.yaml's section (plus the service's endpoint, LOOPBACK and jars).
# Batch, not streaming: this is a bounded read (kafka.bounded=true). In a streaming job a bounded source keeps its
# task running (and the job with it) unless shutdown_sources_after_idle_ms stops it, and with checkpointing on,
# output that fires only at the end of input (here every session and the bounded Iceberg commit) was seen to go
# missing on Beam 2.62 + Flink 1.19 (runners/flink.py); a streaming run would also take the stateful dedup and
# windowed-session paths, not the batch paths the DirectRunner variant measures. Batch runs the same code as the
# ``beamflow`` variant, and the job ends by itself when the input does.
# Parallelism 1, not conf/flink.yaml's 2: at 2 the batch job (55 vertices) failed over once in both runs tried on the
# default local cluster (TaskManager 1728m, 4,096 network buffers): a task asks for the 512 buffers Flink 1.19's
# sort-shuffle needs per blocking result partition while others hold the rest ("Insufficient number of network
# buffers"). The job then restarts that region and finishes, correct but with the failed attempt in its run time.
# ``--flink-parallelism 2`` measures that; the output flags a failover whenever one happens.
FLINK_BENCH: dict[str, Any] = {"streaming": False, "parallelism": 1}
# A variant's subprocess is ended after this long (a streaming Flink job whose source never finishes, say).
VARIANT_TIMEOUT_S = 900
# ``--flink-streaming``: a streaming job instead; its bounded source then stops only after this much idle time.
FLINK_STREAMING_IDLE_MS = 3000


# ---- one variant, run in a subprocess -----------------------------------------------------------------------------


def _usage() -> dict[str, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024}


class StageClock:
    """Wall seconds and bundles per fused stage of FnApiRunner, by wrapping its bundle execution (measurement only).

    A fused stage runs several transforms in one bundle; it is named here by the top-level transforms it contains.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.bundles: dict[str, int] = defaultdict(int)

    def install(self) -> None:
        from apache_beam.runners.portability.fn_api_runner import fn_runner

        original = fn_runner.FnApiRunner._execute_bundle
        clock = self

        def timed(runner: Any, context: Any, bundle_context_manager: Any, bundle_input: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(runner, context, bundle_context_manager, bundle_input)
            finally:
                name = clock.stage_name(bundle_context_manager.stage)
                clock.seconds[name] += time.perf_counter() - start
                clock.bundles[name] += 1

        setattr(fn_runner.FnApiRunner, "_execute_bundle", timed)  # noqa: B010  (measurement only)

    @staticmethod
    def stage_name(stage: Any) -> str:
        names: list[str] = []
        for transform in stage.transforms:
            top = transform.unique_name.split("/")[0]
            if top and not top.startswith("ref_") and top not in names:
                names.append(top)
        return "+".join(names) or stage.name


def run_beamflow(config: dict[str, Any], no_state_cache: bool) -> dict[str, Any]:
    from apache_beam.metrics.metric import MetricsFilter

    import pipelines.clicks as clicks

    if no_state_cache:
        # The proposed runners/direct.py change, applied here only: FnApiRunner's in-process SDK worker builds its
        # StateCache from this module constant; 0 disables the cache (reads go straight to the in-memory state).
        from apache_beam.runners.portability.fn_api_runner import worker_handlers

        worker_handlers.STATE_CACHE_SIZE_MB = 0
    stages = StageClock()
    stages.install()
    start = time.perf_counter()
    result = clicks.run_with_config(config)
    seconds = time.perf_counter() - start
    metrics = result.metrics().query(MetricsFilter().with_name("records_read"))["counters"]
    return {
        "seconds": seconds,
        "records": sum(r.committed or 0 for r in metrics),
        # Which job module ran (it may change between the variants of one run while others edit it).
        "code": _code_digest([clicks.__file__]),
        "stages": dict(stages.seconds),
        "bundles": dict(stages.bundles),
        **_usage(),
    }


def run_flink(config: dict[str, Any]) -> dict[str, Any]:
    """The clicks job on the Flink session cluster; the LOOPBACK SDK workers run in this process."""
    from apache_beam.metrics.metric import MetricsFilter

    import pipelines.clicks as clicks
    from beamflow.flink_rest import FlinkRest

    called = time.time()
    start = time.perf_counter()
    result = clicks.run_with_config(config, runner="FlinkRunner")
    seconds = time.perf_counter() - start
    returned = time.time()
    out: dict[str, Any] = {"seconds": seconds, "state": str(result.state)}
    try:
        counters = result.metrics().query(MetricsFilter().with_name("records_read"))["counters"]
        out["records"] = sum((r.committed or r.attempted or 0) for r in counters)
    except Exception as exc:  # the job server's metrics are best effort; the audit checks the data anyway
        out["metrics_error"] = f"{type(exc).__name__}: {exc}"
    rest = FlinkRest(config["_rest_url"])
    [job] = [j for j in rest.jobs() if j.name == config["flink"]["job_name"]]
    detail = rest.job(job.job_id)
    start_ms, end_ms = int(detail["start-time"]), int(detail["end-time"])
    timestamps = {k: int(v) for k, v in (detail.get("timestamps") or {}).items() if int(v) > 0}
    reasons: list[str] = []
    try:
        entries = rest.job_exceptions(job.job_id).get("exceptionHistory", {}).get("entries", [])
        for entry in entries:
            first = (str(entry.get("stacktrace") or entry.get("exceptionName") or "").strip().splitlines() or [""])[0]
            reasons.append(f"{str(entry.get('taskName') or '')[:80]}: {first[:300]}")
        failures = len(entries)
    except Exception:
        failures = -1
    out.update(
        job_id=job.job_id,
        flink_state=detail["state"],
        job_s=(end_ms - start_ms) / 1000,
        # CREATED -> RUNNING is scheduling and deploying the tasks (and waiting for slots).
        running_s=(end_ms - timestamps.get("RUNNING", start_ms)) / 1000,
        submit_s=start_ms / 1000 - called,
        after_s=returned - end_ms / 1000,
        restarted="RESTARTING" in timestamps,
        failures=failures,
        failure_reasons=reasons,
        vertices=[
            {
                "name": v.get("name", "")[:200],
                "parallelism": v.get("parallelism"),
                "duration_s": int(v.get("duration", 0)) / 1000,
                "read_records": (v.get("metrics") or {}).get("read-records"),
                "write_records": (v.get("metrics") or {}).get("write-records"),
            }
            for v in detail.get("vertices", [])
        ],
        code=_code_digest([clicks.__file__]),
        **_usage(),
    )
    return out


def _code_digest(paths: list[str | None]) -> str:
    import hashlib

    digest = hashlib.sha1(usedforsecurity=False)
    for path in paths:
        if path:
            digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:10]


def _session_rows(events_by_user: dict[str, list[tuple[int, str, int, int]]], gap_ms: int) -> list[tuple[Any, ...]]:
    from beamflow.kafka.offset_ranges import OffsetRanges

    utc = dt.UTC
    rows = []
    for user, events in events_by_user.items():
        events.sort()
        session: list[tuple[int, str, int, int]] = []
        for event in [*events, None]:
            if session and (event is None or event[0] - session[-1][0] >= gap_ms):
                first, last = session[0][0], session[-1][0]
                clicks = sum(1 for _, kind, _, _ in session if kind == "click")
                rows.append(
                    (
                        user,
                        dt.datetime.fromtimestamp(first / 1000, utc),
                        dt.datetime.fromtimestamp((last + gap_ms) / 1000, utc),
                        len(session) - clicks,
                        clicks,
                        dt.datetime.fromtimestamp(first / 1000, utc),
                        dt.datetime.fromtimestamp(last / 1000, utc),
                        len(session),
                        0,
                        True,
                        OffsetRanges.of((p, o) for _, kind, p, o in session if kind != "click").encode(),
                        OffsetRanges.of((p, o) for _, kind, p, o in session if kind == "click").encode(),
                    )
                )
                session = []
            if event is not None:
                session.append(event)
    return rows


def run_baseline(config: dict[str, Any]) -> dict[str, Any]:
    """The same work in one process with no framework: the floor the clicks job is compared with."""
    import psycopg
    from confluent_kafka import Consumer
    from confluent_kafka import TopicPartition as CkTopicPartition
    from psycopg import sql

    from beamflow.avro.registry import SchemaRegistryClient
    from beamflow.avro.serde import AvroDecodeError, AvroDeserializer
    from beamflow.event_id import event_id_from_fields
    from beamflow.generate import EVENT_ID_FIELDS, load_click_schema
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog
    from beamflow.iceberg.committer import ensure_table, rows_to_arrow
    from beamflow.kafka.confluent_backend import TUNED_DEFAULTS
    from pipelines.clicks import click_event, dead_letter_spec, impression_row, quarantine_spec, sessions_spec

    kafka, pg, ice = config["kafka"], config["postgres"], config["iceberg"]
    start = time.perf_counter()
    consumer = Consumer(
        {
            **TUNED_DEFAULTS,
            "bootstrap.servers": kafka["bootstrap"],
            "group.id": kafka["group_id"],
            "enable.auto.commit": False,
            "enable.partition.eof": False,
        }
    )
    topic = kafka["topic"]
    partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
    ends = {p: consumer.get_watermark_offsets(CkTopicPartition(topic, p), timeout=10)[1] for p in partitions}
    consumer.assign([CkTopicPartition(topic, p, 0) for p in partitions])
    remaining = {p for p in partitions if ends[p] > 0}
    position = dict.fromkeys(partitions, 0)

    registry = SchemaRegistryClient(config["registry"]["url"])
    decoder = AvroDeserializer(registry, load_click_schema(2))
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"].get("uri", "")))
    interval = BASELINE_APPEND_INTERVAL_S
    pending: list[dict[str, Any]] = []
    table = None
    appends = 0

    def append() -> None:
        nonlocal table, pending, appends
        if not pending:
            return
        batch = rows_to_arrow(pending)
        if table is None:
            table = ensure_table(catalog, ice["table"], batch.schema, [("event_time", "day")])
        table.append(batch)
        pending, appends = [], appends + 1

    first_seen: dict[str, int] = {}
    sessions: dict[str, list[tuple[int, str, int, int]]] = defaultdict(list)
    dead: list[tuple[Any, ...]] = []
    quarantined: list[tuple[Any, ...]] = []
    records = 0
    last_append = time.monotonic()
    while remaining:
        for msg in consumer.consume(10_000, 0.5):
            if msg.error():
                raise RuntimeError(msg.error())
            p, offset, value = int(msg.partition() or 0), int(msg.offset() or 0), msg.value()
            records += 1
            position[p] = offset + 1
            if position[p] >= ends[p]:
                remaining.discard(p)
            try:
                decoded = decoder.deserialize(value)
            except AvroDecodeError as exc:
                dead.append(
                    (f"{topic}:{p}:{offset}", "DecodeAvro", str(exc), exc.code, topic, p, offset, None, value or b"")
                )
                continue
            decoded["_kafka"] = {"topic": topic, "partition": p, "offset": offset}
            event = click_event(decoded)
            event_id = event["event_id"] = event_id_from_fields(event, EVENT_ID_FIELDS)
            if event_id in first_seen:
                quarantined.append(
                    (
                        topic,
                        p,
                        offset,
                        event_id,
                        "duplicate",
                        dt.datetime.fromtimestamp(event["event_time"] / 1000, dt.UTC),
                        dt.datetime.fromtimestamp(first_seen[event_id] / 1000, dt.UTC),
                    )
                )
                continue
            first_seen[event_id] = event["event_time"]
            pending.append(impression_row(event))
            sessions[event["user_id"]].append((event["event_time"], event["event_type"], p, offset))
        if time.monotonic() - last_append >= interval:
            append()
            last_append = time.monotonic()
    append()

    session_rows = _session_rows(sessions, int(config["sessions"].get("gap_s", 600)) * 1000)
    with psycopg.connect(pg["dsn"], autocommit=False) as conn:
        for spec, rows in (
            (sessions_spec(pg["sessions_table"]), session_rows),
            (quarantine_spec(pg["quarantine_table"]), quarantined),
            (dead_letter_spec(pg["dead_letters_table"]), dead),
        ):
            assert spec.columns is not None
            columns = list(spec.columns)
            conn.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} ({}, PRIMARY KEY ({}))").format(
                    sql.Identifier(spec.table),
                    sql.SQL(", ").join(sql.SQL(f"{{}} {t}").format(sql.Identifier(c)) for c, t in spec.columns.items()),
                    sql.SQL(", ").join(map(sql.Identifier, spec.key)),
                )
            )
            copy_sql = sql.SQL("COPY {} ({}) FROM STDIN").format(
                sql.Identifier(spec.table), sql.SQL(", ").join(map(sql.Identifier, columns))
            )
            with conn.cursor().copy(copy_sql) as copy:
                for row in rows:
                    copy.write_row(row)
        conn.commit()
    consumer.commit(offsets=[CkTopicPartition(topic, p, position[p]) for p in partitions], asynchronous=False)
    consumer.close()
    registry.close()
    return {
        "seconds": time.perf_counter() - start,
        "records": records,
        "iceberg_appends": appends,
        "unique": len(first_seen),
        "sessions": len(session_rows),
        **_usage(),
    }


def use_committed(paths: tuple[str, ...] = HEAD_FILES) -> None:
    """Imports the git HEAD version of each module file in place of the working tree's (before anything imports it)."""
    import importlib
    import types

    repo = Path(__file__).resolve().parents[1]
    for path in paths:
        source = subprocess.run(
            ["git", "show", f"HEAD:{path}"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout
        name = path.removesuffix(".py").replace("/", ".")
        module = types.ModuleType(name)
        module.__file__ = str(repo / path)
        sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
        exec(compile(source, f"HEAD:{path}", "exec"), module.__dict__)  # measurement only
        package, _, leaf = name.rpartition(".")
        if package:
            setattr(importlib.import_module(package), leaf, module)


def _child(variant: str, config_path: str) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, force=True)
    config = json.loads(Path(config_path).read_text())
    if variant == "beamflow-head":
        use_committed()
    if variant == "baseline":
        out = run_baseline(config)
    elif variant == "flink":
        out = run_flink(config)
    else:
        out = run_beamflow(config, no_state_cache=variant == "beamflow-nocache")
    print("RESULT " + json.dumps(out), flush=True)


# ---- the parent: data once, variants in subprocesses, lag sampling -------------------------------------------------


class LagSampler(threading.Thread):
    """Samples (seconds since start, total lag) for one group every ``every_s``: end offsets minus committed."""

    def __init__(self, bootstrap: str, topic: str, group_id: str, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.group_id, self.every_s = bootstrap, topic, group_id, every_s
        self.samples: list[tuple[float, int]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        from confluent_kafka import Consumer
        from confluent_kafka import TopicPartition as CkTopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group_id})
        try:
            partitions = sorted(consumer.list_topics(self.topic, timeout=10).topics[self.topic].partitions)
            tps = [CkTopicPartition(self.topic, p) for p in partitions]
            start = time.monotonic()
            while not self._halt.is_set():
                ends = [consumer.get_watermark_offsets(tp, timeout=5, cached=False)[1] for tp in tps]
                committed = consumer.committed(tps, timeout=5)
                lag = sum(end - max(c.offset, 0) for end, c in zip(ends, committed, strict=True))
                self.samples.append((time.monotonic() - start, lag))
                self._halt.wait(self.every_s)
        finally:
            consumer.close()

    def stop(self) -> list[tuple[float, int]]:
        self._halt.set()
        self.join(30)
        return self.samples


def _proc_cpu_s(pid: int) -> float | None:
    """user + sys CPU seconds of one process (all its threads), from /proc; None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class JvmSampler(threading.Thread):
    """The Flink JVMs of this data folder while the ``flink`` variant runs (measurement only).

    CPU seconds of each role (JobManager, TaskManager, job server) from /proc before and after; the TaskManager's
    RSS (/proc) and JVM heap used (Flink REST ``/taskmanagers/<id>/metrics``) sampled every ``every_s``, peaks kept.
    """

    def __init__(self, roles: dict[str, int], rest_url: str, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.roles, self.rest_url, self.every_s = roles, rest_url, every_s
        self.cpu_before = {role: _proc_cpu_s(pid) for role, pid in roles.items()}
        self.peak_rss_mb = 0.0
        self.peak_heap_mb = 0.0
        self._halt = threading.Event()

    def run(self) -> None:
        from beamflow.flink_rest import FlinkRest

        rest = FlinkRest(self.rest_url, timeout=5)
        tm_id = None
        while not self._halt.is_set():
            rss = _proc_rss_mb(self.roles.get("taskmanager", -1))
            self.peak_rss_mb = max(self.peak_rss_mb, rss or 0.0)
            try:
                tm_id = tm_id or rest.taskmanagers()[0]["id"]
                rows = rest._request("GET", f"/taskmanagers/{tm_id}/metrics?get=Status.JVM.Memory.Heap.Used")
                self.peak_heap_mb = max(self.peak_heap_mb, float(rows[0]["value"]) / 2**20)
            except Exception:  # a missed sample is fine
                pass
            self._halt.wait(self.every_s)

    def stop(self) -> dict[str, Any]:
        self._halt.set()
        self.join(30)
        cpu = {}
        for role, pid in self.roles.items():
            before, after = self.cpu_before[role], _proc_cpu_s(pid)
            cpu[role] = None if before is None or after is None else round(after - before, 2)
        return {"jvm_cpu_s": cpu, "tm_peak_rss_mb": self.peak_rss_mb, "tm_peak_heap_mb": self.peak_heap_mb}


def audit(config: dict[str, Any], expected: dict[str, int]) -> dict[str, Any]:
    """What one variant left in its sinks and its consumer group; ``problems`` lists every mismatch (empty = clean).

    ``expected``: produced ``events``, ``duplicate_sends`` and ``bad_records`` (from the generator).
    """
    import psycopg
    from confluent_kafka import Consumer
    from confluent_kafka import TopicPartition as CkTopicPartition
    from psycopg import sql

    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    kafka, pg, ice = config["kafka"], config["postgres"], config["iceberg"]
    out: dict[str, Any] = {}
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"].get("uri", "")))
    try:
        ids = catalog.load_table(ice["table"]).scan(selected_fields=("event_id",)).to_arrow()["event_id"].to_pylist()
    except Exception as exc:  # reported as a problem
        ids, out["iceberg_error"] = [], f"{type(exc).__name__}: {exc}"
    out["iceberg_rows"], out["iceberg_ids"] = len(ids), len(set(ids))
    with psycopg.connect(pg["dsn"], autocommit=True) as conn:

        def scalar(query: sql.Composed) -> int:
            try:
                row = conn.execute(query).fetchone()
            except psycopg.errors.UndefinedTable:
                return -1
            return int(row[0]) if row else 0

        for name, key in (("quarantined", "quarantine_table"), ("dead_letters", "dead_letters_table")):
            out[name] = scalar(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(pg[key])))
        table = sql.Identifier(pg["sessions_table"])
        out["sessions"] = scalar(sql.SQL("SELECT count(*) FROM {}").format(table))
        out["session_events"] = scalar(sql.SQL("SELECT coalesce(sum(events), 0) FROM {}").format(table))
        out["session_keys_twice"] = scalar(
            sql.SQL(
                "SELECT count(*) FROM (SELECT user_id, session_start FROM {} GROUP BY 1, 2 HAVING count(*) > 1) d"
            ).format(table)
        )
    consumer = Consumer({"bootstrap.servers": kafka["bootstrap"], "group.id": kafka["group_id"]})
    try:
        topic = kafka["topic"]
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        tps = [CkTopicPartition(topic, p) for p in partitions]
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1] for tp in tps}
        committed = {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=10)}
    finally:
        consumer.close()
    out["end_offsets"], out["committed_offsets"] = ends, committed
    problems = [out["iceberg_error"]] if "iceberg_error" in out else []
    for what, got, want in (
        ("iceberg rows", out["iceberg_rows"], expected["events"]),
        ("iceberg distinct event ids", out["iceberg_ids"], expected["events"]),
        ("quarantined duplicates", out["quarantined"], expected["duplicate_sends"]),
        ("dead letters", out["dead_letters"], expected["bad_records"]),
        ("events covered by sessions", out["session_events"], expected["events"]),
        ("session keys written twice", out["session_keys_twice"], 0),
    ):
        if got != want:
            problems.append(f"{what}: {got}, expected {want}")
    behind = {p: (committed.get(p), end) for p, end in ends.items() if committed.get(p) != end}
    if behind:
        problems.append(f"committed offsets != end offsets on partitions {behind} (partition: (committed, end))")
    out["problems"] = problems
    return out


def _variant_config(base: dict[str, Any], variant: str, run_id: str) -> dict[str, Any]:
    config = json.loads(json.dumps(base))
    tag = f"{variant.replace('-', '_')}_{run_id}"
    config["kafka"]["group_id"] = f"e2e-{tag}"
    for key in ("sessions_table", "dead_letters_table", "quarantine_table"):
        config["postgres"][key] = f"{base['postgres'][key]}_{tag}"
    config["iceberg"]["table"] = f"bench.impressions_{tag}"
    config["iceberg"]["sink_id"] = f"e2e-{tag}"
    if variant == "flink":
        config["flink"] = {**config["flink"], "job_name": f"e2e-{tag}"}
    else:
        config.pop("flink", None)
        config.pop("_rest_url", None)
    return config


def run_variant(
    variant: str, config: dict[str, Any], workdir: Path, sample_lag: bool, flink: Any = None
) -> dict[str, Any]:
    path = workdir / f"{variant}.json"
    path.write_text(json.dumps(config))
    sampler = None
    if sample_lag:
        sampler = LagSampler(config["kafka"]["bootstrap"], config["kafka"]["topic"], config["kafka"]["group_id"])
        sampler.start()
    jvms = None
    if flink is not None:
        jvms = JvmSampler(dict(flink.info.get("roles", {})), flink.info["rest_url"])
        jvms.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.e2e", "--child", variant, str(path)],
            capture_output=True,
            text=True,
            check=False,
            timeout=VARIANT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        if flink is not None:  # the child is gone (and its LOOPBACK workers); do not leave its job behind
            from beamflow.flink_rest import TERMINAL_STATES, FlinkRest

            rest = FlinkRest(flink.info["rest_url"])
            for job in rest.jobs():
                if job.name == config["flink"]["job_name"] and job.state not in TERMINAL_STATES:
                    rest.cancel(job.job_id)
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        raise RuntimeError(f"variant {variant} not done after {VARIANT_TIMEOUT_S}s:\n{stderr[-3000:]}") from exc
    finally:
        lag = sampler.stop() if sampler else []
        jvm = jvms.stop() if jvms else {}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"variant {variant} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["lag"] = lag
    result.update(jvm)
    return result


def _job_seconds(r: dict[str, Any]) -> float:
    """The time a variant's throughput is taken over: the job run on Flink, the whole run otherwise."""
    return float(r.get("job_s", r["seconds"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the variants this many times, interleaved; keep each one's fastest"
    )
    parser.add_argument("--json", help="write all figures (and lag samples) here")
    parser.add_argument("--plot", help="write the PNG plot here (needs --kafka-json for the read panel, optional)")
    parser.add_argument("--kafka-json", help="benchmarks.kafka_read --json output to include in the plot")
    parser.add_argument(
        "--flink-parallelism", type=int, help=f"parallelism of the flink variant (default {FLINK_BENCH['parallelism']})"
    )
    parser.add_argument(
        "--flink-streaming",
        action="store_true",
        help="run the flink variant as a streaming job (checkpointing as in conf/flink.yaml) whose bounded source "
        f"shuts down after {FLINK_STREAMING_IDLE_MS} ms idle, instead of batch",
    )
    parser.add_argument(
        "--keep-services", action="store_true", help="leave kafka, postgres, registry (and flink) running"
    )
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0

    from beamflow.services import ServiceSet
    from beamflow.services.paths import data_dir

    workdir = Path(data_dir()) / "bench"
    workdir.mkdir(parents=True, exist_ok=True)
    services = ServiceSet(data=workdir)
    names = ["kafka", "postgres", "registry"]
    if "flink" in args.variants.split(","):
        names.append("flink")  # a Flink session cluster of this data folder, started like the others
    try:
        for name in names:
            services.get(name).up()
        return _measure(args, services, workdir)
    finally:
        if not args.keep_services:
            services.down(names)


def _measure(args: argparse.Namespace, services: Any, workdir: Path) -> int:
    from beamflow.config import load_config, resolve_auto
    from beamflow.generate import TrafficSpec, avro_click_encoder, generate_traffic, produce_traffic
    from beamflow.kafka.admin import create_topic

    run_id = uuid.uuid4().hex[:6]
    base = resolve_auto(load_config("conf/clicks.yaml"), services)
    flink_conf = base.pop("flink", None) or {}
    base["kafka"]["topic"] = f"e2e-{run_id}"
    base["kafka"]["bounded"] = True
    variants = args.variants.split(",")
    flink = None
    if "flink" in variants:

        flink = services.get("flink").up()
        base["_rest_url"] = flink.info["rest_url"]  # for run_flink; the job ignores unknown top-level keys
        base["flink"] = {
            **flink_conf,
            **FLINK_BENCH,
            "job_endpoint": flink.info["job_endpoint"],
            "environment": "LOOPBACK",
            "files_to_stage": [flink.info["marker_jar"]],
            "parallelism": args.flink_parallelism or FLINK_BENCH["parallelism"],
        }
        if args.flink_streaming:
            base["flink"].update(streaming=True, shutdown_sources_after_idle_ms=FLINK_STREAMING_IDLE_MS)
    spec = TrafficSpec(events=args.events, partitions=int(base["kafka"].get("partitions", 4)))
    create_topic(base["kafka"]["bootstrap"], base["kafka"]["topic"], spec.partitions)
    traffic = generate_traffic(spec, avro_click_encoder(base["registry"]["url"], base["registry"]["subject"]))
    produce_traffic(base["kafka"]["bootstrap"], base["kafka"]["topic"], traffic)
    total = len(traffic.records)
    load_at_start = os.getloadavg()
    print(
        f"{total:,} records ({args.events:,} events) on {spec.partitions} partitions; nproc={os.cpu_count()}, "
        f"load average {load_at_start[0]:.1f}"
    )

    expected = {k: int(traffic.counts[k]) for k in ("events", "duplicate_sends", "bad_records")}
    results: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    problems: dict[str, list[str]] = {}
    for attempt in range(max(1, args.repeat)):
        for variant in variants:
            config = _variant_config(base, variant, f"{run_id}{attempt}")
            r = run_variant(
                variant, config, workdir, sample_lag=variant != "baseline", flink=flink if variant == "flink" else None
            )
            r["load"] = os.getloadavg()[0]
            if r.get("records") is None:
                print(
                    f"WARNING: {variant}: no records_read metric ({r.get('metrics_error')}); using the produced count"
                )
                r["records"], r["records_from"] = total, "produced"
            if r["records"] != total:
                print(f"WARNING: {variant} read {r['records']} of {total} records")
            r["audit"] = audit(config, expected)
            if r["audit"]["problems"]:
                problems[f"{variant} #{attempt + 1}"] = r["audit"]["problems"]
            a = r["audit"]
            print(
                f"  {variant} done: {r['seconds']:.1f}s"
                + (f" (job run {r['job_s']:.1f}s, submission {r['submit_s']:.1f}s)" if "job_s" in r else "")
                + f", CPU {r['cpu_s']:.1f}s, load {r['load']:.1f}"
                + (f", code {r['code']}" if "code" in r else "")
                + f"; audit: iceberg {a['iceberg_rows']:,} rows / {a['iceberg_ids']:,} ids, quarantined "
                f"{a['quarantined']}, dead letters {a['dead_letters']}, sessions {a['sessions']:,}, committed = end "
                f"offsets on {sum(a['committed_offsets'].get(p) == e for p, e in a['end_offsets'].items())}/"
                f"{len(a['end_offsets'])} partitions" + (f"; PROBLEMS: {a['problems']}" if a["problems"] else "; OK")
            )
            keep = ("seconds", "job_s", "submit_s", "cpu_s", "load", "code")
            runs[variant].append({k: r[k] for k in keep if k in r})
            if variant not in results or _job_seconds(r) < _job_seconds(results[variant]):
                results[variant] = r
    for variant, r in results.items():
        r["runs"] = runs[variant]
    # Every variant writes the same sessions (the baseline computes them by hand): compare the counts too.
    session_counts = {v: r["audit"]["sessions"] for v, r in results.items()}
    if len(set(session_counts.values())) > 1:
        problems["sessions"] = [f"session rows differ between variants: {session_counts}"]

    base_r = results.get("baseline")
    print(
        f"\n{'variant':22} {'wall s':>7} {'rec/s':>8} {'CPU s':>7} {'rec/CPU s':>10} {'peak MB':>8} "
        f"{'x rec/s':>8} {'x rec/CPU':>9} {'x mem':>6}"
    )
    for variant, r in results.items():
        if variant != "flink":
            _row(variant, r["records"], r["seconds"], r["cpu_s"], r["peak_rss_mb"], base_r)
            continue
        jvm_cpu = sum(v for v in (r.get("jvm_cpu_s") or {}).values() if v)
        _row("flink (total wall)", r["records"], r["seconds"], r["cpu_s"] + jvm_cpu, r["peak_rss_mb"], base_r)
        _row("flink (job run)", r["records"], r["job_s"], None, None, base_r)
    print(f"(goal: beamflow >= {GOAL}x the baseline's records/s; 'x mem' is peak RSS relative to the baseline)")
    if "flink" in results:
        r = results["flink"]
        cpu = r.get("jvm_cpu_s") or {}
        print(
            f"\nflink: job {r['job_id']} {r['flink_state']}, "
            + ("streaming" if base["flink"].get("streaming") else "batch (streaming: false)")
            + f", parallelism "
            f"{base['flink']['parallelism']}, LOOPBACK SDK workers in the submitting process; restarted: "
            f"{r['restarted']}, failures in Flink's exception history: {r['failures']}\n"
            f"  total wall {r['seconds']:.1f}s (run_with_config) = submission {r['submit_s']:.1f}s (call -> Flink "
            f"start-time: pipeline construction, job server translation, upload of the staged jars)\n"
            f"    + job run {r['job_s']:.1f}s (Flink start-time -> end-time from REST; {r['running_s']:.1f}s of it "
            f"RUNNING since it last entered that state) + {r['after_s']:.1f}s (end-time -> run_with_config returned)\n"
            f"  records/s: {r['records'] / r['job_s']:,.0f} over the job run, {r['records'] / r['seconds']:,.0f} "
            f"over the total wall"
            + (
                f" ({r['records'] / r['job_s'] / _rate(base_r):.2f}x and "
                f"{r['records'] / r['seconds'] / _rate(base_r):.2f}x the baseline's)"
                if base_r
                else ""
            )
            + f"\n  CPU s: submitting process {r['cpu_s']:.1f} (LOOPBACK Python workers included), "
            + ", ".join(f"{role} {v:.1f}" if v is not None else f"{role} ?" for role, v in cpu.items())
            + " (JVM deltas over the variant's whole run; 'CPU s' of the total-wall row is their sum)\n"
            f"  memory: peak RSS of the submitting process {r['peak_rss_mb']:.0f} MB (the Flink JVMs are NOT in it); "
            f"TaskManager JVM peak RSS {r.get('tm_peak_rss_mb', 0):.0f} MB, peak heap used "
            f"{r.get('tm_peak_heap_mb', 0):.0f} MB (sampled every 0.5 s)"
        )
        tasks = sum(int(v["parallelism"] or 0) for v in r["vertices"])
        print(f"  {len(r['vertices'])} Flink vertices, {tasks} tasks (per vertex: durations and records in the JSON)")
        if r["restarted"] or r["failures"]:
            print(
                f"  WARNING: the Flink job failed over during the run ({r['failures']} failure(s) in its exception "
                f"history): its job run time includes the failed attempt and the restart; see {r['job_id']}'s "
                "exceptions in Flink REST"
            )
            for reason in r.get("failure_reasons", []):
                print(f"    {reason}")
    for variant, r in results.items():
        if "stages" in r:
            print(f"\nwall seconds per fused stage ({variant}, job {r['seconds']:.1f}s):")
            for stage, seconds in sorted(r["stages"].items(), key=lambda kv: -kv[1])[:10]:
                rate = r["records"] / seconds if seconds else 0
                print(f"  {seconds:7.2f}s {rate:>10,.0f} rec/s {r['bundles'][stage]:>4} bundles  {stage[:90]}")

    for name, found in problems.items():
        print(f"AUDIT PROBLEM ({name}): {'; '.join(found)}")
    if not problems:
        print("\naudit: every variant's sinks hold every record exactly where it belongs; offsets committed to the end")

    figures = {
        "records": total,
        "events": args.events,
        "nproc": os.cpu_count(),
        "load": load_at_start,
        "load_at_end": os.getloadavg(),
        "expected": expected,
        "flink_options": {k: v for k, v in base.get("flink", {}).items() if k != "files_to_stage"},
        "results": results,
        "problems": problems,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if args.plot:
        from benchmarks.plot import plot

        kafka = json.loads(Path(args.kafka_json).read_text()) if args.kafka_json else None
        plot(figures, kafka, args.plot)
        print(f"plot written to {args.plot}")
    return 1 if problems else 0


def _rate(r: dict[str, Any] | None) -> float:
    return r["records"] / r["seconds"] if r else 0.0


def _row(
    label: str, records: int, seconds: float, cpu_s: float | None, rss_mb: float | None, base: dict[str, Any] | None
) -> None:
    """One line of the table; CPU and memory columns left empty when not given (the Flink job-run row)."""
    rate = records / seconds
    cpu_rate = records / max(cpu_s, 1e-9) if cpu_s is not None else None
    cells = [f"{label:22} {seconds:7.1f} {rate:8,.0f}"]
    cells.append(
        f"{cpu_s:7.1f} {cpu_rate:10,.0f}" if cpu_s is not None and cpu_rate is not None else f"{'-':>7} {'-':>10}"
    )
    cells.append(f"{rss_mb:8.0f}" if rss_mb is not None else f"{'-':>8}")
    if base:
        b_cpu = base["records"] / max(base["cpu_s"], 1e-9)
        cells.append(f"{rate / _rate(base):8.2f}")
        cells.append(f"{cpu_rate / b_cpu:9.2f}" if cpu_rate is not None else f"{'-':>9}")
        cells.append(f"{rss_mb / base['peak_rss_mb']:6.2f}" if rss_mb is not None else f"{'-':>6}")
    print(" ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
