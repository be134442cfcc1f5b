"""The parent: services up, the topic filled once, each variant in its own subprocess, audited, reported."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.e2e.audit import audit
from benchmarks.e2e.report import print_report
from benchmarks.e2e.samplers import JvmSampler, LagSampler
from benchmarks.e2e.settings import FLINK_BENCH, FLINK_STREAMING_IDLE_MS, VARIANT_TIMEOUT_S, VARIANTS
from benchmarks.e2e.variants import _child


def _variant_config(base: dict[str, Any], variant: str, run_id: str) -> dict[str, Any]:
    config = json.loads(json.dumps(base))
    tag = f"{variant.replace('-', '_')}_{run_id}"
    config["kafka"]["group_id"] = f"e2e-{tag}"
    for key in ("sessions_table", "dead_letters_table", "quarantine_table"):
        config["postgres"][key] = f"{base['postgres'][key]}_{tag}"
    config["iceberg"]["table"] = f"bench.impressions_{tag}"
    config["iceberg"]["sink_id"] = f"e2e-{tag}"
    if variant == "beamflow-1p":  # the local job in one process, whatever the conf's kafka.local_processes
        config["kafka"]["local_processes"] = 1
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
    raw = load_config("conf/clicks.yaml")
    flink_conf = raw.pop("flink", None) or {}  # filled in below for the flink variant from the service it started
    base = resolve_auto(raw, services)
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

    print_report(results, base, problems)

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
