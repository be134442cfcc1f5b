"""What every beamflow job shares: its command line, runner options, the Kafka read, the dedup table, the quarantine
and dead-letter sinks, and running a built pipeline on the local runner or Flink.

A job module gives its own ``build_pipeline(p, config)`` and default conf; ``JobRunner`` does the rest, the same way
for each job (``python -m pipelines.clicks``, ``python -m pipelines.rides``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.metrics.metric import MetricResults, MetricsFilter
from apache_beam.runners.runner import PipelineResult, PipelineState

from beamflow.config import (
    ConfigError,
    JobConfig,
    as_job_config,
    load_job_config,
    required,
    resolve_auto,
    start_services,
)
from beamflow.kafka.admin import committed_offsets, end_offsets
from beamflow.postgres.table import TableSpec
from beamflow.process_memory import own_peak_rss_mb
from runners.local_processes import partition_groups, processes_for, run_in_processes
from transforms.deduplicate import FirstCopyTable, QuarantinedEvent
from transforms.read_from_kafka import ReadFromKafka, StartPolicy, StopPolicy
from transforms.write_dead_letters import WriteDeadLetters

__all__ = [
    "JobRunner",
    "PartOutcome",
    "ProcessesResult",
    "RunsResult",
    "dead_letter_sink",
    "epoch_ms_event",
    "first_copy_table",
    "quarantine_row",
    "quarantine_spec",
    "read_records",
    "reads_in_one_run",
    "utc",
]

_LOG = logging.getLogger("pipelines")


def utc(ms: int | float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000.0, tz=dt.UTC)


def epoch_ms_event(decoded: dict[str, Any], field: str = "event_time") -> dict[str, Any]:
    """A decoded event with ``field`` as epoch milliseconds (Avro's timestamp-millis decodes to a datetime)."""
    event = dict(decoded)
    when = event[field]
    if isinstance(when, dt.datetime):
        event[field] = int(when.timestamp() * 1000)
    return event


def quarantine_spec(table: str) -> TableSpec:
    """The quarantine table: one row per later copy of an event (by its Kafka coordinates), with why."""
    return TableSpec(
        table,
        key=("topic", "kafka_partition", "kafka_offset"),
        columns={
            "topic": "text NOT NULL",
            "kafka_partition": "integer NOT NULL",
            "kafka_offset": "bigint NOT NULL",
            "event_id": "text",
            "reason": "text NOT NULL",
            "event_time": "timestamptz",
            "first_seen": "timestamptz",
        },
    )


def quarantine_row(q: QuarantinedEvent) -> dict[str, Any]:
    kafka = q.event["_kafka"]
    return {
        "topic": kafka["topic"],
        "kafka_partition": kafka["partition"],
        "kafka_offset": kafka["offset"],
        "event_id": None if q.event_id is None else str(q.event_id),
        "reason": q.reason,
        "event_time": q.event_time.to_utc_datetime(has_tz=True),
        "first_seen": q.first_seen.to_utc_datetime(has_tz=True) if q.first_seen is not None else None,
    }


def read_records(p: beam.Pipeline, config: JobConfig, label: str) -> beam.PCollection:
    """The job's Kafka read as its ``kafka:`` section says. A bounded read does not commit offsets itself: the job
    commits them after its sinks (``CommitOffsetsAfter``); a streaming one commits on finalization."""
    kafka = required(config.kafka, "kafka")
    return p | label >> ReadFromKafka(
        kafka.bootstrap,
        [kafka.topic],
        group_id=kafka.group_id,
        backend=kafka.backend,
        start=StartPolicy(kafka.start),
        stop=StopPolicy(
            at_end_offsets=kafka.bounded,
            max_records_per_partition=kafka.run_records_per_partition if kafka.bounded else None,
        ),
        max_delay_ms=kafka.max_delay_ms,
        idle_timeout_ms=kafka.idle_timeout_ms,
        max_bundle_records=kafka.max_bundle_records,
        consumer_config=dict(kafka.consumer_config) or None,
        commit_offsets=not kafka.bounded,
        partitions=kafka.only_partitions,
    )


def first_copy_table(config: JobConfig) -> FirstCopyTable | None:
    """The dedup's PostgreSQL table for ``dedup.strategy`` ``auto`` (the default) or ``store``.

    Why the store in every mode: on portable runners per-key state is a blocking round trip per event, while the
    table is one transaction per bundle; and it remembers first copies across restores and across bounded runs, so a
    duplicate whose original came in an earlier run is quarantined too (a per-run grouping cannot see it, and the
    sessions would count it twice). ``grouped`` and ``state`` keep the runner-only strategies.
    """
    if config.dedup.strategy in ("auto", "store"):
        pg = required(config.postgres, "postgres")
        return FirstCopyTable(pg.dsn, pg.first_copies)
    return None


def dead_letter_sink(config: JobConfig) -> WriteDeadLetters:
    """``dead_letters.sink``: the PostgreSQL dead-letter table, or a Kafka topic (default ``<kafka.topic>-dlq``)."""
    kafka, pg, dlq = required(config.kafka, "kafka"), required(config.postgres, "postgres"), config.dead_letters
    if dlq.sink == "kafka":
        from beamflow.kafka.admin import connection_settings

        return WriteDeadLetters(
            "kafka",
            bootstrap=kafka.bootstrap,
            topic=dlq.topic or f"{kafka.topic}-dlq",
            # The read's listener and credentials (secret references stay references until the producer opens).
            producer_config=connection_settings(kafka.consumer_config),
        )
    return WriteDeadLetters("postgres", dsn=pg.dsn, table=pg.dead_letters_table)


def reads_in_one_run(job: JobConfig) -> JobConfig:
    """``job`` without ``kafka.run_records_per_partition``: runs in pieces are the local runner's way to bound its
    memory; a Flink job (stream or batch) reads to the end in one job, whoever submits it."""
    if job.kafka is None or job.kafka.run_records_per_partition is None:
        return job
    return dataclasses.replace(job, kafka=dataclasses.replace(job.kafka, run_records_per_partition=None))


class RunsResult(PipelineResult):
    """The runs of one job run in pieces (``kafka.run_records_per_partition``), as one result: the last run's state,
    and every run's metrics (a counter's results of all runs, so summing them counts the whole job)."""

    def __init__(self, results: Sequence[PipelineResult]) -> None:
        super().__init__(results[-1].state)
        self.results = list(results)

    def wait_until_finish(self, duration: int | None = None) -> Any:
        return self.results[-1].wait_until_finish(duration)

    def metrics(self) -> MetricResults:
        return _AllRunsMetrics([result.metrics() for result in self.results])


class _AllRunsMetrics(MetricResults):
    def __init__(self, runs: Sequence[MetricResults]) -> None:
        self._runs = runs

    def query(self, filter: MetricsFilter | None = None) -> dict[str, list[Any]]:
        merged: dict[str, list[Any]] = {}
        for run in self._runs:
            for kind, found in run.query(filter).items():
                merged.setdefault(kind, []).extend(found)
        return merged


@dataclass(frozen=True)
class PartOutcome:
    """What one process of a split local run hands back: its final state, every metric its runs reported (unfiltered:
    the launcher filters), and its own peak resident memory."""

    state: str
    metrics: dict[str, list[Any]]
    peak_rss_mb: float


class ProcessesResult(PipelineResult):
    """A bounded local run split over processes (``kafka.local_processes``), as one result: done when every process
    was, and the metrics of all of them (summing a counter's results counts the whole job)."""

    def __init__(self, outcomes: Sequence[PartOutcome]) -> None:
        states = {o.state for o in outcomes}
        super().__init__(states.pop() if len(states) == 1 else PipelineState.UNKNOWN)
        self.outcomes = list(outcomes)

    def wait_until_finish(self, duration: int | None = None) -> Any:
        return self.state

    def metrics(self) -> MetricResults:
        return _AllRunsMetrics([_StoredMetrics(o.metrics) for o in self.outcomes])


class _StoredMetrics(MetricResults):
    """One process's metrics as it handed them back (``PartOutcome.metrics``), filtered on query."""

    def __init__(self, stored: dict[str, list[Any]]) -> None:
        self._stored = stored

    def query(self, filter: MetricsFilter | None = None) -> dict[str, list[Any]]:
        return {kind: [r for r in found if self.matches(filter, r.key)] for kind, found in self._stored.items()}


def _offsets_left(ends: Mapping[int, int], position: Mapping[int, int | None]) -> int:
    """Offsets between each partition's position (None: nothing committed, counted from 0) and its end."""
    return sum(max(end - (position.get(part) or 0), 0) for part, end in ends.items())


@dataclass(frozen=True)
class _Part:
    """One process's share of a split local run (pickled into a spawned process)."""

    job_runner: JobRunner
    job: JobConfig
    runner: str
    beam_args: tuple[str, ...]

    def describe(self) -> str:
        kafka = required(self.job.kafka, "kafka")
        return f"partitions {list(kafka.only_partitions or ())} of {kafka.topic}"


def _run_part(part: _Part) -> PartOutcome:
    result = part.job_runner.run_with_config(part.job, part.runner, part.beam_args)
    return PartOutcome(str(result.state), result.metrics().query(), own_peak_rss_mb())


@dataclass(frozen=True)
class JobRunner:
    """Runs one job: ``build`` builds it into a pipeline from a resolved config; ``conf`` is its default file."""

    prog: str
    description: str
    conf: str
    build: Callable[[beam.Pipeline, JobConfig], Any]
    log: logging.Logger = _LOG

    def parse_args(self, argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
        parser = argparse.ArgumentParser(prog=self.prog, description=self.description)
        parser.add_argument("--conf", default=self.conf, help="job configuration YAML (default: %(default)s)")
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
        parser.add_argument(
            "--runner", default="DirectRunner", help="DirectRunner (pinned local runner) or FlinkRunner"
        )
        parser.add_argument(
            "--start-services",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="start the local services the conf's `auto` endpoints name before running (default: yes; with "
            "--no-start-services an `auto` service that is not running is an error)",
        )
        parser.add_argument(
            "--attached",
            action="store_true",
            help="FlinkRunner: wait until the job ends (default: return once it runs; LOOPBACK jobs always wait)",
        )
        return parser.parse_known_args(argv)

    def for_runner(self, config: JobConfig | Mapping[str, Any], runner: str) -> JobConfig:
        """The job's config as ``runner`` runs it.

        A streaming Flink job reads the topic as a stream: ``kafka.bounded`` (true in the shipped confs for the local
        demo) applies to local and batch runs only. A bounded read inside a streaming job would never let its
        end-of-input groupings fire (sources stay up for checkpoints), and its after-the-sinks commit needs side
        inputs that Beam's Flink runner cannot checkpoint in streaming mode. ``flink.streaming=false`` runs a bounded
        batch job.
        """
        job = as_job_config(config)
        if runner != "FlinkRunner":
            return dataclasses.replace(job, flink=None)
        job = reads_in_one_run(job)
        kafka = required(job.kafka, "kafka")
        if (job.flink is None or job.flink.streaming) and kafka.bounded:
            self.log.info(
                "streaming Flink job: reading %s as a stream (kafka.bounded applies to batch runs)", kafka.topic
            )
            job = dataclasses.replace(job, kafka=dataclasses.replace(kafka, bounded=False))
        return job

    def pipeline_options(self, runner: str, beam_args: Sequence[str], config: JobConfig | Mapping[str, Any]) -> Any:
        job = as_job_config(config)
        if runner == "FlinkRunner":
            from runners.flink import flink_options

            return flink_options(job.flink.settings() if job.flink else {}, beam_args)
        if runner not in ("DirectRunner", "FnApiRunner"):
            raise SystemExit(f"unknown --runner {runner}: use DirectRunner or FlinkRunner")
        if not (job.kafka and job.kafka.bounded):
            # FnApiRunner runs stage after stage: the read of a stream never finishes, so nothing after it ever runs.
            raise SystemExit(
                "kafka.bounded=false needs a streaming runner: the local runner (FnApiRunner) runs stage after stage "
                "and would write nothing; use --runner=FlinkRunner, or Prism (runners/prism.py), to stream"
            )
        from runners.direct import local_options

        return local_options(beam_args)

    def run_with_config(
        self,
        config: JobConfig | Mapping[str, Any],
        runner: str = "DirectRunner",
        beam_args: Sequence[str] = (),
        attached: bool = True,
    ) -> PipelineResult:
        """Builds and runs the job for an already resolved config.

        Waits until it finishes, except a Flink job with ``attached=False`` whose workers run beside the TaskManagers:
        that returns once the job runs, and the job goes on without this process.
        """
        job = as_job_config(config)
        if runner == "FlinkRunner":
            job = reads_in_one_run(job)
        if runner == "FlinkRunner" and not (job.flink and job.flink.job_name):
            job = job.with_flink(job_name=job.job.name)
        flink = job.flink.settings() if job.flink else {}
        if runner == "FlinkRunner":
            from runners.flink import SubmissionError, check_reachable

            try:
                check_reachable(flink)
            except SubmissionError as exc:
                raise SystemExit(f"beamflow: {exc}") from None
        local_bounded = runner != "FlinkRunner" and job.kafka is not None and job.kafka.bounded
        if local_bounded and job.kafka and job.kafka.local_processes > 1 and job.kafka.only_partitions is None:
            return self._run_in_processes(job, runner, beam_args)
        if local_bounded and job.kafka and job.kafka.run_records_per_partition:
            return self._run_in_pieces(job, runner, beam_args)
        p = beam.Pipeline(options=self.pipeline_options(runner, beam_args, job))
        self.build(p, job)
        result = p.run()
        if runner == "FlinkRunner" and not attached:
            from runners.flink import environment_kind, failed_submission, wait_until_running

            if environment_kind(flink.get("environment", "LOOPBACK")) != "LOOPBACK":
                options = p.options.get_all_options(retain_unknown_options=True)
                job_name = options.get("job_name") or flink.get("job_name")
                state = wait_until_running(result, job_name, flink.get("rest_url"))
                failure = failed_submission(state, job_name, flink.get("rest_url"))
                if failure:  # a deployment script must not take a job that never ran for a running one
                    raise SystemExit(f"beamflow: {failure}")
                self.log.info(
                    "job %s is %s on the Flink cluster; this process may exit (`beamflow flink jobs` lists it)",
                    job_name,
                    state,
                )
                return result
        result.wait_until_finish()
        return result

    def _run_in_pieces(self, job: JobConfig, runner: str, beam_args: Sequence[str]) -> PipelineResult:
        """Bounded local runs of at most ``kafka.run_records_per_partition`` records per partition each, one after
        the other, until the group's committed offsets reach the end offsets seen now (records produced meanwhile
        are left to the next command, as one bounded run leaves them). Each run commits after its sinks, and the
        sinks, the dedup's first copies and the sessions are exact across runs, so the pieces write what one run
        over everything would (``tests/e2e/test_clicks_pipeline.py`` compares them)."""
        kafka = required(job.kafka, "kafka")
        per_run = kafka.run_records_per_partition
        settings = kafka.consumer_config
        mine = kafka.only_partitions

        def own(offsets: dict[int, Any]) -> dict[int, Any]:  # another process of a split run reads the others
            return offsets if mine is None else {p: o for p, o in offsets.items() if p in mine}

        goal = own(end_offsets(kafka.bootstrap, kafka.topic, settings))
        results: list[PipelineResult] = []
        position = own(committed_offsets(kafka.bootstrap, kafka.topic, kafka.group_id, settings))
        while True:
            p = beam.Pipeline(options=self.pipeline_options(runner, beam_args, job))
            self.build(p, job)
            result = p.run()
            result.wait_until_finish()
            results.append(result)
            before, position = position, own(committed_offsets(kafka.bootstrap, kafka.topic, kafka.group_id, settings))
            left = _offsets_left(goal, position)
            if not left:
                break
            if position == before:
                # Nothing committed: the offsets left below the end hold no records this group reads (transaction
                # markers, records deleted by retention, or a new group starting at latest), so another run would read
                # nothing either.
                self.log.warning(
                    "%s: run %d committed nothing; the %d offsets left below the end offsets hold no records to read",
                    kafka.topic,
                    len(results),
                    left,
                )
                break
            self.log.info(
                "%s: run %d of at most %d records per partition done; %d offsets left",
                kafka.topic,
                len(results),
                per_run,
                left,
            )
        return RunsResult(results)

    @staticmethod
    def _one_process(job: JobConfig) -> JobConfig:
        kafka = required(job.kafka, "kafka")
        return dataclasses.replace(job, kafka=dataclasses.replace(kafka, local_processes=1))

    def _run_in_processes(self, job: JobConfig, runner: str, beam_args: Sequence[str]) -> PipelineResult:
        """The bounded local run split over ``kafka.local_processes`` spawned processes, each running this job (in
        pieces, if so configured) over its own partitions of the topic, dealt round robin
        (``runners.local_processes``). Returns once all have ended, with every process's metrics."""
        kafka = required(job.kafka, "kafka")
        if job.dedup is not None and job.dedup.in_runner_state:  # another process could not see its first copies
            self.log.warning(
                "dedup.strategy %s keeps first copies in one process: the local run stays in one process",
                job.dedup.strategy,
            )
            return self.run_with_config(self._one_process(job), runner, beam_args)
        ends = end_offsets(kafka.bootstrap, kafka.topic, kafka.consumer_config)
        committed = committed_offsets(kafka.bootstrap, kafka.topic, kafka.group_id, kafka.consumer_config)
        # At most (offsets below the low watermark or holding transaction markers are counted too): a heuristic.
        backlog = _offsets_left(ends, committed)
        processes = processes_for(backlog, kafka.local_processes, kafka.local_process_records)
        if processes == 1:
            return self.run_with_config(self._one_process(job), runner, beam_args)
        groups = partition_groups(list(ends), processes)
        parts = [
            _Part(
                self,
                dataclasses.replace(job, kafka=dataclasses.replace(kafka, only_partitions=g)),
                runner,
                tuple(beam_args),
            )
            for g in groups
        ]
        self.log.info("%s: a local run in %d processes, partitions %s", kafka.topic, len(parts), groups)
        return ProcessesResult(run_in_processes(_run_part, parts, describe=_Part.describe))

    def run(self, argv: Sequence[str]) -> PipelineResult:
        args, beam_args = self.parse_args(list(argv))
        try:
            config = self.for_runner(load_job_config(args.conf, args.set), args.runner)
            if args.start_services:
                # Explicit: the local services this run's `auto` endpoints name (running ones are left as they are).
                started = start_services(config)
                if started:
                    self.log.info("local services for the conf's auto endpoints: %s (running)", ", ".join(started))
            config = resolve_auto(config)
        except ConfigError as exc:
            # A user error (the conf, a --set, an `auto` service not running): one line and exit code 2.
            print(f"beamflow: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        return self.run_with_config(config, args.runner, beam_args, attached=args.attached)

    def main(self, argv: Sequence[str]) -> int:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
        logging.getLogger("apache_beam").setLevel(logging.WARNING)
        self.run(argv)
        return 0
