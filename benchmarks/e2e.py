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

While the beamflow variants run, a thread samples the group's committed offsets against the end offsets (consumer
lag over time). Printed: wall seconds, records/s, CPU seconds (user+sys of the subprocess), peak RSS, the ratios to the
baseline, and for beamflow the wall time per fused stage (FnApiRunner bundles timed from outside).
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

VARIANTS = ("baseline", "beamflow-head", "beamflow")
# What the ``beamflow-head`` variant takes from git HEAD instead of the working tree.
HEAD_FILES = ("transforms/deduplicate.py", "transforms/hot_key_aggregate.py")
GOAL = 0.5
# The baseline appends to Iceberg at most this often (the issue: "one Iceberg append per interval").
BASELINE_APPEND_INTERVAL_S = 5.0


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


def _code_digest(paths: list[str | None]) -> str:
    import hashlib

    digest = hashlib.sha1(usedforsecurity=False)
    for path in paths:
        if path:
            digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:10]


def _session_rows(events_by_user: dict[str, list[tuple[int, str]]], gap_ms: int) -> list[tuple[Any, ...]]:
    utc = dt.UTC
    rows = []
    for user, events in events_by_user.items():
        events.sort()
        session: list[tuple[int, str]] = []
        for event in [*events, None]:
            if session and (event is None or event[0] - session[-1][0] >= gap_ms):
                first, last = session[0][0], session[-1][0]
                clicks = sum(1 for _, kind in session if kind == "click")
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
    sessions: dict[str, list[tuple[int, str]]] = defaultdict(list)
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
            sessions[event["user_id"]].append((event["event_time"], event["event_type"]))
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


def _variant_config(base: dict[str, Any], variant: str, run_id: str) -> dict[str, Any]:
    config = json.loads(json.dumps(base))
    tag = f"{variant.replace('-', '_')}_{run_id}"
    config["kafka"]["group_id"] = f"e2e-{tag}"
    for key in ("sessions_table", "dead_letters_table", "quarantine_table"):
        config["postgres"][key] = f"{base['postgres'][key]}_{tag}"
    config["iceberg"]["table"] = f"bench.impressions_{tag}"
    config["iceberg"]["sink_id"] = f"e2e-{tag}"
    return config


def run_variant(variant: str, config: dict[str, Any], workdir: Path, sample_lag: bool) -> dict[str, Any]:
    path = workdir / f"{variant}.json"
    path.write_text(json.dumps(config))
    sampler = None
    if sample_lag:
        sampler = LagSampler(config["kafka"]["bootstrap"], config["kafka"]["topic"], config["kafka"]["group_id"])
        sampler.start()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.e2e", "--child", variant, str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    lag = sampler.stop() if sampler else []
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"variant {variant} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["lag"] = lag
    return result


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
    parser.add_argument("--keep-services", action="store_true", help="leave kafka, postgres, registry running")
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
    for name in ("kafka", "postgres", "registry"):
        services.get(name).up()
    try:
        return _measure(args, services, workdir)
    finally:
        if not args.keep_services:
            services.down(["kafka", "postgres", "registry"])


def _measure(args: argparse.Namespace, services: Any, workdir: Path) -> int:
    from beamflow.config import load_config, resolve_auto
    from beamflow.generate import TrafficSpec, avro_click_encoder, generate_traffic, produce_traffic
    from beamflow.kafka.admin import create_topic

    run_id = uuid.uuid4().hex[:6]
    base = resolve_auto(load_config("conf/clicks.yaml"), services)
    base.pop("flink", None)
    base["kafka"]["topic"] = f"e2e-{run_id}"
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

    results: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for attempt in range(max(1, args.repeat)):
        for variant in args.variants.split(","):
            config = _variant_config(base, variant, f"{run_id}{attempt}")
            r = run_variant(variant, config, workdir, sample_lag=variant != "baseline")
            r["load"] = os.getloadavg()[0]
            if r["records"] != total:
                print(f"WARNING: {variant} read {r['records']} of {total} records")
            print(
                f"  {variant} done: {r['seconds']:.1f}s, CPU {r['cpu_s']:.1f}s, load {r['load']:.1f}"
                + (f", code {r['code']}" if "code" in r else "")
            )
            runs[variant].append({k: r[k] for k in ("seconds", "cpu_s", "load", "code") if k in r})
            if variant not in results or r["seconds"] < results[variant]["seconds"]:
                results[variant] = r
    for variant, r in results.items():
        r["runs"] = runs[variant]

    base_r = results.get("baseline")
    print(
        f"\n{'variant':18} {'wall s':>7} {'rec/s':>8} {'CPU s':>7} {'rec/CPU s':>10} {'peak MB':>8} "
        f"{'x rec/s':>8} {'x rec/CPU':>9} {'x mem':>6}"
    )
    for variant, r in results.items():
        rate, cpu_rate = r["records"] / r["seconds"], r["records"] / max(r["cpu_s"], 1e-9)
        ratios = ""
        if base_r:
            b_rate, b_cpu = base_r["records"] / base_r["seconds"], base_r["records"] / max(base_r["cpu_s"], 1e-9)
            ratios = f"{rate / b_rate:8.2f} {cpu_rate / b_cpu:9.2f} {r['peak_rss_mb'] / base_r['peak_rss_mb']:6.2f}"
        print(
            f"{variant:18} {r['seconds']:7.1f} {rate:8,.0f} {r['cpu_s']:7.1f} {cpu_rate:10,.0f} "
            f"{r['peak_rss_mb']:8.0f} {ratios}"
        )
    print(f"(goal: beamflow >= {GOAL}x the baseline's records/s; 'x mem' is peak RSS relative to the baseline)")
    for variant, r in results.items():
        if "stages" in r:
            print(f"\nwall seconds per fused stage ({variant}, job {r['seconds']:.1f}s):")
            for stage, seconds in sorted(r["stages"].items(), key=lambda kv: -kv[1])[:10]:
                rate = r["records"] / seconds if seconds else 0
                print(f"  {seconds:7.2f}s {rate:>10,.0f} rec/s {r['bundles'][stage]:>4} bundles  {stage[:90]}")

    figures = {
        "records": total,
        "events": args.events,
        "nproc": os.cpu_count(),
        "load": load_at_start,
        "results": results,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if args.plot:
        from benchmarks.plot import plot

        kafka = json.loads(Path(args.kafka_json).read_text()) if args.kafka_json else None
        plot(figures, kafka, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
