"""``beamflow doctor CONF``: a deployment checked against the seeds' failure modes, with reasons and fixes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from beamflow.config import JobConfig
    from beamflow.doctor import Finding


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check a job config (and optionally live Kafka/Flink) for known traps"
    )
    parser.add_argument("conf", help="job config YAML, e.g. conf/clicks.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--kafka", default=None, help="bootstrap servers: also check partition count and record gaps")
    parser.add_argument("--flink-rest", default=None, help="http://host:port: also read live checkpoint statistics")
    parser.add_argument("--job-id", default=None, help="Flink job to inspect (default: the running one)")
    parser.add_argument(
        "--pipeline",
        default=None,
        help="module whose build_pipeline() to inspect (default: pipelines.<job.name> if there is one, else "
        "pipelines.clicks)",
    )
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from beamflow.config import ConfigError, load_job_config
    from beamflow.doctor import (
        check_checkpoint_stats,
        check_config,
        check_record_gaps,
        format_findings,
        sample_record_gaps,
    )

    try:
        config = load_job_config(args.conf, args.set)
    except (ConfigError, OSError) as exc:
        print(f"beamflow doctor: {exc}", file=sys.stderr)
        return 2
    partitions = None
    findings = []
    if args.kafka and config.kafka is not None:
        from beamflow.kafka.admin import topic_partition_count

        topic = config.kafka.topic
        client = config.kafka.consumer_config  # SASL_SSL brokers: the job's own listener and credentials
        partitions = topic_partition_count(args.kafka, topic, config=client)
        findings += check_record_gaps(
            sample_record_gaps(args.kafka, topic, config=client), config.kafka.idle_timeout_ms
        )
        if config.kafka_sink is not None:
            findings += _sink_timestamps(args.kafka, config)
    findings = check_config(config, partitions) + findings
    pipeline = args.pipeline or _job_module(config.job.name)
    if pipeline:
        import importlib

        from beamflow.doctor import check_unstable_names, pipeline_labels

        module = importlib.import_module(pipeline)
        findings += check_unstable_names(pipeline_labels(lambda p: module.build_pipeline(p, config)))
    if args.flink_rest:
        from beamflow.flink_rest import FlinkRest

        rest = FlinkRest(args.flink_rest)
        if config.flink is not None and config.flink.streaming:
            from beamflow.doctor import check_flink_classpath

            known = partitions or (config.kafka.partitions if config.kafka else None)
            findings += check_flink_classpath(rest.jobmanager_classpath(), known)
            from beamflow.doctor import check_flink_state_config

            findings += check_flink_state_config(rest.config(), config.flink.checkpointing_interval_ms)
        job_id = args.job_id or next((j.job_id for j in rest.jobs() if j.state == "RUNNING"), None)
        if job_id is None:
            print("doctor: no running Flink job to inspect")
        else:
            stats = rest.checkpoints(job_id)
            interval = config.flink.checkpointing_interval_ms if config.flink else None
            findings += check_checkpoint_stats(stats, interval)
    if args.json:
        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        format_findings(findings)
    return 1 if any(f.severity == "error" for f in findings) else 0


def _sink_timestamps(bootstrap: str, config: JobConfig) -> list[Finding]:
    """``check_sink_timestamps`` against the live sink topic and the job's unread backlog (no sink topic yet: none)."""
    import time

    from beamflow.doctor import check_sink_timestamps, oldest_unread_ms
    from beamflow.kafka.producer import KafkaWriteError, topic_config

    sink, kafka = config.kafka_sink, config.kafka
    if sink is None or kafka is None:
        return []
    sink_bootstrap = bootstrap if sink.bootstrap in (None, "auto") else sink.bootstrap
    try:
        settings = topic_config(sink_bootstrap, sink.topic, config=sink.producer_config)
    except KafkaWriteError:
        return []  # the job or its demo creates it
    oldest = oldest_unread_ms(bootstrap, kafka.topic, kafka.group_id, kafka.start, kafka.consumer_config)
    return check_sink_timestamps(sink.topic, settings, sink.timestamps, oldest, int(time.time() * 1000))


def _job_module(name: str) -> str:
    """The job module a conf's ``job.name`` names (``rides`` -> ``pipelines.rides``), found by name only (the engines
    import no job), else the clicks job."""
    import importlib.util

    candidate = f"pipelines.{name}"
    try:
        found = name.isidentifier() and importlib.util.find_spec(candidate) is not None
    except ModuleNotFoundError:
        found = False
    return candidate if found else "pipelines.clicks"
