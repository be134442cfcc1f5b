"""``beamflow status``: a running job's Beam metrics and checkpoint statistics, read from Flink's REST API.

Beam's Flink runner reports every user metric (``Metrics.counter(namespace, name)``) as a Flink operator metric of the
fused stage that ran it, per subtask, named ``<subtask>.<operator>.<namespace with . as _>_<name>``, e.g.
``0.[13]{ReadClicks__DecodeAvro__...}.beamflow_kafka_records_read``; ``/jobs/<id>/accumulators`` stays empty. This
command lists each vertex's metric ids, fetches the ``beamflow_*`` ones and sums them over subtasks. With ``--conf``
(the job's configuration) it also shows the consumer group's lag per partition and the Iceberg sink's commits.

Across failovers: Flink restarts every operator metric at zero with each attempt (a restore from a checkpoint, a
restarted task), so the Beam counters cover the current attempt only and are labelled so. The figures since the job
started come from where the records ended up, which survives every attempt: the Iceberg table's rows, the
PostgreSQL quarantine, dead-letter and sessions tables, and the consumer group's committed offsets (``--conf``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from beamflow.flink_rest import TERMINAL_STATES, FlinkRest, FlinkRestError

__all__ = ["JobStatus", "beam_metrics", "collect_status", "format_status", "metrics_gap", "register"]

_BEAM_PREFIX = "beamflow_"
# Flink reports "no watermark yet" as Long.MIN_VALUE; Beam's end of time (a finished input) is about 2**63 / 1000 ms.
_NO_WATERMARK_MS = -(2**63)
_END_OF_TIME_MS = (2**63 - 1) // 1000
_REST_GET_BATCH = 40  # metric ids per request: ids are long, keep URLs modest

# Known metrics, in display order: (metric name as Flink shows it, label). Others are listed after these.
KNOWN_METRICS: tuple[tuple[str, str], ...] = (
    ("beamflow_kafka_records_read", "records read from Kafka"),
    ("beamflow_kafka_bytes_read", "bytes read from Kafka"),
    ("beamflow_kafka_late_records", "late records (behind the partition watermark)"),
    ("beamflow_kafka_idle_polls", "idle polls"),
    ("beamflow_decode_avro_decoded", "records decoded"),
    ("beamflow_decode_avro_dead_letters", "dead letters from decoding"),
    ("beamflow_dead_letters_dead_letters", "dead letters (all stages)"),
    ("beamflow_deduplicate_unique", "unique events"),
    ("beamflow_deduplicate_duplicates", "duplicates quarantined"),
    ("beamflow_hot_key_aggregate_input_elements", "session inputs"),
    ("beamflow_hot_key_aggregate_aggregated_elements", "session inputs aggregated (not late)"),
    ("beamflow_iceberg_commits", "Iceberg commits"),
    ("beamflow_iceberg_rows_written", "Iceberg rows written"),
    ("beamflow_iceberg_rows_existing_key", "Iceberg rows already in the table (replays)"),
    ("beamflow_iceberg_known_keys_scans", "Iceberg key lookups that scanned the table"),
    ("beamflow_iceberg_known_keys_held", "Iceberg keys held by the committers"),
    ("beamflow_postgres_rows_written", "PostgreSQL rows written"),
    ("beamflow_postgres_retries", "PostgreSQL retries"),
)


@dataclass
class JobStatus:
    job_id: str
    name: str
    state: str
    metrics: dict[str, float] = field(default_factory=dict)  # beam metric name -> sum over subtasks
    checkpoints: dict[str, Any] = field(default_factory=dict)
    min_output_watermark_ms: int | None = None  # None: no vertex has advanced its watermark yet
    kafka_lag: dict[int, int] | None = None  # partition -> end offset - committed offset
    iceberg_commits: list[dict[str, Any]] | None = None  # newest first: time, rows added
    # Since the job started, from the sinks (all attempts): label -> count; None without --conf.
    sink_totals: dict[str, int] | None = None
    metrics_gap: str | None = None  # why a running job shows no Beam metric (``metrics_gap``)

    @property
    def late_dropped(self) -> float | None:
        """Inputs minus aggregated, or None when unknown: Flink restarts operator counters with each task attempt,
        and after a failover the two stages may have restarted at different points (aggregated > inputs)."""
        inputs = self.metrics.get("beamflow_hot_key_aggregate_input_elements")
        aggregated = self.metrics.get("beamflow_hot_key_aggregate_aggregated_elements")
        if inputs is None or aggregated is None or aggregated > inputs:
            return None
        return inputs - aggregated


def _metric_name(metric_id: str) -> str | None:
    """``0.<operator>.beamflow_x_y`` -> ``beamflow_x_y`` (operator names may contain dots, metric names not first)."""
    at = metric_id.find("." + _BEAM_PREFIX)
    return metric_id[at + 1 :] if at >= 0 else None


def beam_metrics(rest: FlinkRest, job_id: str) -> tuple[dict[str, float], int | None]:
    """Beam user metrics summed over subtasks and vertices, and the lowest output watermark of any vertex."""
    totals: dict[str, float] = {}
    watermarks: list[int] = []
    for vertex in rest.job(job_id).get("vertices", []):
        path = f"/jobs/{job_id}/vertices/{vertex['id']}/metrics"
        ids = [m["id"] for m in rest._request("GET", path)]
        wanted = [i for i in ids if _metric_name(i) or i.endswith(".currentOutputWatermark")]
        for start in range(0, len(wanted), _REST_GET_BATCH):
            batch = wanted[start : start + _REST_GET_BATCH]
            for row in rest._request("GET", f"{path}?get={','.join(batch)}"):
                try:
                    value = float(row["value"])
                except (KeyError, TypeError, ValueError):
                    continue
                name = _metric_name(row["id"])
                if name:
                    totals[name] = totals.get(name, 0.0) + value
                elif row["id"].endswith(".currentOutputWatermark"):
                    watermarks.append(int(value))
    advanced = [w for w in watermarks if _NO_WATERMARK_MS < w < _END_OF_TIME_MS]
    stuck = any(w <= _NO_WATERMARK_MS for w in watermarks)
    return totals, (None if stuck or not advanced else min(advanced))


def metrics_gap(rest: FlinkRest, job_id: str) -> str | None:
    """Why the JobManager shows a running job no Beam metric, or None when it shows some (or the job is not running).

    Flink's REST API answers from the JobManager's metric store, which its metric fetcher fills from each
    TaskManager's metric query service at most every 10 s; a gap leaves a vertex with no metric ids, not an error.
    This says where the gap is (per vertex: ids held for the vertex and for each subtask; per TaskManager: its own
    metrics held), so an empty ``beamflow status`` is not read as "the job counted nothing".
    """
    job = rest.job(job_id)
    if job.get("state") != "RUNNING":
        return None
    vertices = job.get("vertices", [])
    lines: list[str] = []
    for vertex in vertices:
        path = f"/jobs/{job_id}/vertices/{vertex['id']}"
        ids = [m["id"] for m in rest._request("GET", f"{path}/metrics")]
        if any(_metric_name(i) for i in ids):
            return None
        subtasks = [
            len(rest._request("GET", f"{path}/subtasks/{index}/metrics"))
            for index in range(int(vertex.get("parallelism", 1)))
        ]
        lines.append(f"{vertex['name'][:60]} ({vertex.get('status')}): {len(ids)} metric ids, per subtask {subtasks}")
    held = {tm["id"]: len(rest._request("GET", f"/taskmanagers/{tm['id']}/metrics")) for tm in rest.taskmanagers()}
    return (
        "the JobManager holds no Beam metric of this running job (its metric fetcher has not reached the tasks'"
        f" TaskManagers, or no bundle has finished yet): {'; '.join(lines)}; metric ids per TaskManager {held}"
    )


def checkpoint_summary(rest: FlinkRest, job_id: str) -> dict[str, Any]:
    stats = rest.checkpoints(job_id)
    counts = stats.get("counts", {})
    latest = stats.get("latest") or {}
    completed = latest.get("completed") or {}
    failed = latest.get("failed") or {}
    restored = latest.get("restored") or {}
    out: dict[str, Any] = {
        "completed": counts.get("completed", 0),
        "failed": counts.get("failed", 0),
        "in_progress": counts.get("in_progress", 0),
        "restored": counts.get("restored", 0),
    }
    if completed:
        out["latest_id"] = completed.get("id")
        out["latest_age_s"] = round(time.time() - completed.get("latest_ack_timestamp", 0) / 1000.0, 1)
        out["latest_duration_ms"] = completed.get("end_to_end_duration")
        out["latest_size_bytes"] = completed.get("checkpointed_size", completed.get("state_size"))
        out["latest_path"] = completed.get("external_path")
    if failed:
        out["latest_failure"] = failed.get("failure_message")
    if restored:
        out["restored_from"] = restored.get("external_path")
    summary = stats.get("summary", {}).get("end_to_end_duration", {})
    if summary:
        out["duration_ms_avg"] = summary.get("avg")
        out["duration_ms_max"] = summary.get("max")
    return out


def group_positions(config: Mapping[str, Any]) -> dict[int, tuple[int, int, int]]:
    """Per partition of the job's topic: (earliest offset, end offset, the group's committed offset or -1)."""
    from confluent_kafka import Consumer, TopicPartition

    kafka = config["kafka"]
    consumer = Consumer(
        {"bootstrap.servers": kafka["bootstrap"], "group.id": kafka["group_id"], "enable.auto.commit": False}
    )
    try:
        metadata = consumer.list_topics(kafka["topic"], timeout=10).topics[kafka["topic"]]
        parts = [TopicPartition(kafka["topic"], p) for p in sorted(metadata.partitions)]
        committed = {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=10)}
        positions: dict[int, tuple[int, int, int]] = {}
        for tp in parts:
            low, high = consumer.get_watermark_offsets(tp, timeout=10)
            position = committed.get(tp.partition, -1)
            positions[tp.partition] = (low, high, position if position >= 0 else -1)
        return positions
    finally:
        consumer.close()


def kafka_lag(config: Mapping[str, Any]) -> dict[int, int]:
    """End offset minus the group's committed offset per partition (the whole partition when nothing is committed)."""
    return {p: high - (pos if pos >= 0 else low) for p, (low, high, pos) in group_positions(config).items()}


def iceberg_commits(config: Mapping[str, Any], last: int = 3) -> list[dict[str, Any]]:
    """The newest Iceberg snapshots of the job's table: when each was committed and how many rows it added."""
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    ice = config["iceberg"]
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"].get("uri", "")))
    snapshots = sorted(catalog.load_table(ice["table"]).snapshots(), key=lambda s: s.timestamp_ms, reverse=True)
    out = []
    for snapshot in snapshots[:last]:
        summary = snapshot.summary.additional_properties if snapshot.summary is not None else {}
        out.append({"timestamp_ms": snapshot.timestamp_ms, "added_records": int(summary.get("added-records", 0))})
    return out


# sink_totals keys, in display order, with their labels.
SINK_TOTALS: tuple[tuple[str, str], ...] = (
    ("kafka_committed", "records committed to the consumer group"),
    ("iceberg_rows", "rows in the Iceberg table"),
    ("quarantined", "duplicates in the quarantine table"),
    ("dead_letters", "dead letters in the dead-letter table"),
    ("session_rows", "rows in the sessions table"),
)


def sink_totals(config: Mapping[str, Any]) -> dict[str, int]:
    """What the job's sinks hold now, whatever attempt wrote it (a missing sink or table is left out).

    Kafka: committed minus earliest offset, summed over partitions (what the job made durable and committed; the
    group starts at the earliest offset). Iceberg: the current snapshot's ``total-records``. PostgreSQL: row counts.
    """
    out: dict[str, int] = {}
    try:
        out["kafka_committed"] = committed_records(config)
    except Exception as exc:
        print(f"kafka committed offsets unavailable: {exc}", file=sys.stderr)
    try:
        from beamflow.iceberg.catalog import CatalogConfig, open_catalog

        ice = config["iceberg"]
        catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"].get("uri", "")))
        snapshot = catalog.load_table(ice["table"]).current_snapshot()
        summary = snapshot.summary.additional_properties if snapshot and snapshot.summary else {}
        out["iceberg_rows"] = int(summary.get("total-records", 0))
    except Exception as exc:  # no table before the first commit
        print(f"iceberg rows unavailable: {exc}", file=sys.stderr)
    pg = config.get("postgres") or {}
    if pg.get("dsn"):
        import psycopg
        from psycopg import sql

        from beamflow.secrets import SecretError, postgres_conninfo

        tables = {"quarantined": pg.get("quarantine_table"), "session_rows": pg.get("sessions_table")}
        if ((config.get("dead_letters") or {}).get("sink") or "postgres") == "postgres":
            tables["dead_letters"] = pg.get("dead_letters_table")
        try:
            with psycopg.connect(postgres_conninfo(pg["dsn"]), autocommit=True, connect_timeout=10) as conn:
                for key, table in tables.items():
                    if not table:
                        continue
                    try:
                        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
                    except psycopg.errors.UndefinedTable:
                        continue
                    out[key] = int(row[0]) if row else 0
        except (psycopg.OperationalError, SecretError) as exc:  # down, refused, or a secret that is not there
            print(f"postgres counts unavailable: {exc}", file=sys.stderr)
    return out


def committed_records(config: Mapping[str, Any]) -> int:
    """Committed minus earliest offset, summed over the partitions the group has committed."""
    return sum(pos - low for low, _, pos in group_positions(config).values() if pos >= 0)


def find_job(rest: FlinkRest, wanted: str | None) -> str:
    """A job id: ``wanted`` as an id or (part of) a name, else the newest running job."""
    jobs = rest.jobs()
    if wanted:
        for job in jobs:
            if job.job_id == wanted or wanted in job.name:
                return job.job_id
        raise FlinkRestError(f"no job with id or name {wanted!r}; jobs: {[j.name for j in jobs]}")
    running = [j for j in jobs if j.state not in TERMINAL_STATES]
    if not running:
        raise FlinkRestError("no running job on the cluster; pass --job to see a finished one")
    return running[0].job_id


def collect_status(rest: FlinkRest, job_id: str, config: Mapping[str, Any] | None = None) -> JobStatus:
    job = rest.job(job_id)
    metrics, watermark = beam_metrics(rest, job_id)
    status = JobStatus(
        job_id=job_id,
        name=str(job.get("name", "")),
        state=str(job.get("state", "")),
        metrics=metrics,
        checkpoints=checkpoint_summary(rest, job_id),
        min_output_watermark_ms=watermark,
    )
    if not metrics:
        status.metrics_gap = metrics_gap(rest, job_id)
    if config is not None:
        try:
            status.kafka_lag = kafka_lag(config)
        except Exception as exc:  # the table still shows what Flink knows
            print(f"kafka lag unavailable: {exc}", file=sys.stderr)
        try:
            status.iceberg_commits = iceberg_commits(config)
        except Exception as exc:
            print(f"iceberg commits unavailable: {exc}", file=sys.stderr)
        status.sink_totals = sink_totals(config)
    return status


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000.0)) + f" ({time.time() - ms / 1000.0:.0f}s ago)"


def format_status(status: JobStatus) -> str:
    rows: list[tuple[str, str]] = [("job", f"{status.name} ({status.job_id})"), ("state", status.state)]
    if status.sink_totals is not None:
        rows.append(("SINCE THE JOB STARTED", "from the sinks, all attempts"))
        for key, label in SINK_TOTALS:
            rows.append((f"  {label}", f"{status.sink_totals[key]:,}" if key in status.sink_totals else "n/a"))
    restores = status.checkpoints.get("restored", 0)
    rows.append(
        (
            "CURRENT ATTEMPT ONLY",
            f"Beam counters restart at 0 with every attempt ({restores} restore{'s' if restores != 1 else ''} so far)",
        )
    )
    shown = set()
    for name, label in KNOWN_METRICS:
        if name in status.metrics:
            rows.append((f"  {label}", f"{status.metrics[name]:,.0f}"))
            shown.add(name)
    if status.metrics_gap:
        rows.append(("  no Beam metric", status.metrics_gap))
    if status.late_dropped is not None:
        rows.append(("  session inputs dropped as too late", f"{status.late_dropped:,.0f}"))
    for name in sorted(set(status.metrics) - shown):
        rows.append((f"  {name}", f"{status.metrics[name]:,.0f}"))
    if status.kafka_lag is not None:
        rows.append(("Kafka lag (end - committed), total", f"{sum(status.kafka_lag.values()):,}"))
        for partition, lag in sorted(status.kafka_lag.items()):
            rows.append((f"  partition {partition}", f"{lag:,}"))
    else:
        rows.append(("Kafka lag", "n/a (pass --conf)"))
    watermark = status.min_output_watermark_ms
    rows.append(("lowest output watermark", "not advanced (-inf)" if watermark is None else _when(watermark)))
    cp = status.checkpoints
    rows.append(
        ("checkpoints completed / failed / in progress", f"{cp['completed']} / {cp['failed']} / {cp['in_progress']}")
    )
    rows.append(("restores", str(cp["restored"])))
    if "latest_id" in cp:
        rows.append(("latest checkpoint", f"#{cp['latest_id']}, {cp['latest_age_s']}s ago"))
        rows.append(("  duration / size", f"{cp['latest_duration_ms']} ms / {cp['latest_size_bytes']:,} bytes"))
        rows.append(("  Kafka offsets commit after it", "yes (bundle finalizers run on checkpoint completion)"))
    if "duration_ms_avg" in cp:
        rows.append(("checkpoint duration avg / max", f"{cp['duration_ms_avg']} / {cp['duration_ms_max']} ms"))
    if cp.get("restored_from"):
        rows.append(("restored from", str(cp["restored_from"])))
    if cp.get("latest_failure"):
        rows.append(("latest checkpoint failure", str(cp["latest_failure"])[:100]))
    if status.iceberg_commits is not None:
        for i, commit in enumerate(status.iceberg_commits):
            label = "Iceberg sink commits (newest first)" if i == 0 else ""
            rows.append((label, f"{_when(commit['timestamp_ms'])}, +{commit['added_records']:,} rows"))
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 2 + max(len(v) for _, v in rows))
    return "\n".join([rule, *(f"{k:<{width}}  {v}" for k, v in rows), rule])


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="a Flink job's Beam metrics (current attempt), checkpoints, and with --conf what its sinks hold since it "
        "started (all attempts)",
    )
    parser.add_argument("--rest", help="Flink REST address (default: the local FlinkService)")
    parser.add_argument("--job", help="job id or (part of) its name (default: the newest running job)")
    parser.add_argument(
        "--conf", help="the job's config YAML: adds Kafka lag, Iceberg commits and the sinks' totals since the start"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from beamflow.cli.flink import _rest
    from beamflow.services import ServiceError

    try:
        rest = _rest(args)
        config = None
        if args.conf:
            from beamflow.config import load_job_config, resolve_auto

            # The job's typed configuration (validated, defaults applied); `auto` endpoints must be running services.
            config = resolve_auto(load_job_config(args.conf, args.set)).to_dict()
        status = collect_status(rest, find_job(rest, args.job), config)
    except (FlinkRestError, ServiceError, OSError, ValueError) as exc:  # ValueError: beamflow.config.ConfigError
        from beamflow.config import ConfigError

        print(f"beamflow status: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1  # 2: the user's config or flags are wrong
    if args.json:
        print(json.dumps({**asdict(status), "late_dropped": status.late_dropped}, indent=2, default=str))
    else:
        print(format_status(status))
    return 0
