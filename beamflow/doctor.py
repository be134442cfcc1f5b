"""``beamflow doctor``: checks a deployment against the failure modes of the seed stories. No Beam.

Each finding names the seed it comes from, says why it matters and how to fix it. Static checks read the job's
config; live checks (optional) read Kafka (partition counts, the normal gap between records) and Flink's REST API
(checkpoint durations and which phase dominates: alignment, synchronous snapshot, or asynchronous upload).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from beamflow.config import FlinkConfig, JobConfig, as_job_config
from beamflow.kafka.commits import DEFAULT_ROUND_GAP_S
from beamflow.services.beam_patches import SDF_RESIDUALS_JAR

__all__ = [
    "RULES",
    "Finding",
    "Job",
    "check_checkpoint_stats",
    "check_config",
    "check_flink_classpath",
    "check_flink_state_config",
    "check_record_gaps",
    "check_sink_timestamps",
    "format_findings",
    "oldest_unread_ms",
    "rule_code",
]


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str  # error | warning | info
    message: str
    why: str
    fix: str


_RUN_ID = re.compile(r"(\d{8,}|[0-9a-f]{8}-[0-9a-f]{4}-|run[-_]?\d|job[-_]?id)", re.IGNORECASE)
# Above these, a checkpoint barrier on a backlog waits for more work than a 30 s timeout allows (issue 13: 100,000
# stalled every checkpoint of the clicks job at 50,000 events).
MAX_BARRIER_BUNDLE = 5_000
MAX_READ_CALL_RECORDS = 5_000


@dataclass(frozen=True)
class Job:
    """What the static rules read: the job's typed config and the topic's partition count (live, else the conf's)."""

    config: JobConfig
    partitions: int | None

    @property
    def flink(self) -> FlinkConfig | None:
        return self.config.flink

    @property
    def streaming_flink(self) -> FlinkConfig | None:
        """The flink section when the job runs as a Flink stream (where the backlog-stall rules apply)."""
        return self.flink if self.flink is not None and self.flink.streaming else None


Rule = Callable[[Job], Finding | None]
# The static rules, in report order; each is one function named after the finding code it produces.
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


@rule
def no_flink_section(job: Job) -> Finding | None:
    if job.flink is not None:
        return None
    return Finding(
        "no-flink-section",
        "info",
        "no flink section: Flink checks skipped",
        "this config only describes a local run",
        "add a flink: section (see conf/flink.yaml) to check a deployment",
    )


@rule
def parallelism_above_partitions(job: Job) -> Finding | None:
    parallelism = job.flink.parallelism if job.flink else None
    partitions = job.partitions
    if not (parallelism and partitions and parallelism > partitions):
        return None
    return Finding(
        "parallelism-above-partitions",
        "warning",
        f"parallelism {parallelism} is above the topic's {partitions} partitions",
        "seed 000: raising source parallelism from 48 to 96 on 48 partitions left 48 source subtasks idle "
        "while adding state, checkpoint work, sink writers and small files; hot keys still hit a few subtasks",
        f"set parallelism to {partitions} (or add partitions), fix the checkpoint path first, and use "
        "HotKeyAggregate for skew instead of more parallelism",
    )


@rule
def partitions_uneven_over_readers(job: Job) -> Finding | None:
    parallelism = job.flink.parallelism if job.flink else None
    partitions = job.partitions
    if not (parallelism and partitions and 1 < parallelism < partitions and partitions % parallelism):
        return None
    fuller = -(-partitions // parallelism)
    return Finding(
        "partitions-uneven-over-readers",
        "info",
        f"{partitions} partitions over {parallelism} read subtasks: {partitions % parallelism} of them read {fuller}",
        "a partition's pace is its read subtask's cycle (each cycle drains every partition the subtask reads), so "
        "a backlog catches up at the pace of the fuller subtasks (measured: one subtask reading three of four "
        "partitions held a p2 job to its pace, docs/streaming.md); ReadFromKafka spreads partitions round robin",
        f"use a partition count that is a multiple of the parallelism (e.g. {fuller * parallelism})",
    )


@rule
def checkpointing_off(job: Job) -> Finding | None:
    if job.flink is None or job.flink.checkpointing_interval_ms:
        return None
    return Finding(
        "checkpointing-off",
        "error",
        "checkpointing is off",
        "without completed checkpoints Flink never finalizes bundles: Kafka offsets are never committed and "
        "a restart replays from the beginning of the group's offsets",
        "set flink.checkpointing_interval_ms (e.g. 10000-60000)",
    )


@rule
def checkpoint_timeout_far_above_interval(job: Job) -> Finding | None:
    interval = job.flink.checkpointing_interval_ms if job.flink else None
    timeout = job.flink.checkpoint_timeout_ms if job.flink else None
    if not (interval and timeout and timeout > 3 * interval):
        return None
    return Finding(
        "checkpoint-timeout-far-above-interval",
        "warning",
        f"checkpoint timeout {timeout} ms is more than 3x the interval {interval} ms",
        "seed 002: raising the timeout to 30 minutes hides slow checkpoints; Flink does not start a new "
        "checkpoint while one runs, so the effective interval silently grows and so does replay after a "
        "failure",
        "fix throughput and alignment (backpressure) first; keep the timeout near 2x the expected duration",
    )


@rule
def no_min_pause(job: Job) -> Finding | None:
    if not (job.flink and job.flink.checkpointing_interval_ms) or job.flink.min_pause_between_checkpoints_ms:
        return None
    return Finding(
        "no-min-pause",
        "warning",
        "no minimum pause between checkpoints",
        "a checkpoint that takes as long as the interval is followed at once by the next: the job does "
        "nothing but checkpoint",
        "set flink.min_pause_between_checkpoints_ms (e.g. half the interval)",
    )


@rule
def min_pause_below_commit_round(job: Job) -> Finding | None:
    gap_ms = int(DEFAULT_ROUND_GAP_S * 1000)
    min_pause = job.flink.min_pause_between_checkpoints_ms if job.flink else None
    if not (job.flink and job.flink.checkpointing_interval_ms and min_pause and min_pause < gap_ms):
        return None
    return Finding(
        "min-pause-below-commit-round",
        "warning",
        f"minimum pause between checkpoints {min_pause} ms is below ReadFromKafka's {gap_ms} ms finalization round gap",
        f"the read commits offsets one checkpoint late and tells checkpoints apart by a pause of over {gap_ms} "
        "ms between finalizations; with shorter pauses rounds merge and commits lag further behind",
        f"set flink.min_pause_between_checkpoints_ms to at least {gap_ms} (e.g. half the interval)",
    )


def _state_backend(flink: FlinkConfig) -> str:
    return str(flink.state_backend or "hashmap").lower()  # Flink's default


@rule
def non_incremental_state(job: Job) -> Finding | None:
    if not (job.flink and _state_backend(job.flink) == "rocksdb" and job.flink.incremental is False):
        return None
    return Finding(
        "non-incremental-state",
        "warning",
        "RocksDB state without incremental checkpoints",
        "seed 002: 40 GB uploaded per checkpoint is a full snapshot every time",
        "set flink.incremental: true",
    )


@rule
def rocksdb_manifest_grows(job: Job) -> Finding | None:
    if not (job.flink and _state_backend(job.flink) == "rocksdb" and not job.flink.rocksdb_max_manifest_bytes):
        return None
    return _manifest_grows("with this config", job.flink.checkpointing_interval_ms)


@rule
def heap_state_for_sessions(job: Job) -> Finding | None:
    if not (job.flink and _state_backend(job.flink) == "hashmap" and job.config.sessions.gap_s):
        return None
    return Finding(
        "heap-state-for-sessions",
        "info",
        "session windows on the heap state backend",
        "seed 000: 2.5 GB of session state on 8 GB heaps made checkpoints and GC pauses long",
        "use state_backend: rocksdb with incremental: true for large keyed state",
    )


@rule
def aligned_checkpoints_under_backpressure(job: Job) -> Finding | None:
    if not (job.flink and job.flink.checkpointing_interval_ms) or job.flink.unaligned_checkpoints is not None:
        return None
    return Finding(
        "aligned-checkpoints-under-backpressure",
        "info",
        "unaligned checkpoints not configured",
        "seed 002: under sustained backpressure barriers queue behind in-flight records (alignment time)",
        "fix the slow operator first; if alignment still dominates, set flink.unaligned_checkpoints: true",
    )


@rule
def offsets_ahead_of_sinks(job: Job) -> Finding | None:
    if job.flink is None or job.flink.finish_bundle_before_checkpointing:
        return None
    return Finding(
        "offsets-ahead-of-sinks",
        "error",
        "bundles are not finished before checkpointing",
        "Flink then checkpoints a bundle's pending output instead of delivering it, so the Kafka offsets "
        "committed when the checkpoint completes can run ahead of what the sinks hold (seed 003)",
        "set flink.finish_bundle_before_checkpointing: true",
    )


_TIMED_FLUSH = re.compile(r"^data_buffer_time_limit_ms=(\d+)$")


@rule
def timed_flush_cuts_elements(job: Job) -> Finding | None:
    timed = (
        [e for e in (job.flink.experiments or ()) if (m := _TIMED_FLUSH.match(e)) and int(m[1]) > 0]
        if job.flink
        else []
    )
    if not timed:
        return None
    return Finding(
        "timed-flush-cuts-elements",
        "error",
        f"flink.experiments has {timed[0]}",
        "Beam 2.62's Python workers then flush their output from a timer thread that takes a lock the element "
        "encoder never takes, so a flush can send half an element: measured here, the runner failed the first "
        "checkpoint with an EOFException decoding the read's output and the job restarted",
        "drop it; data_buffer_size_limit=<bytes> shrinks only the runner's own sends to the workers, and "
        "flink.max_bundle_size bounds what a Python stage holds",
    )


# Settings that bring back the streaming job's backlog stall (docs/streaming.md says what bounds a barrier).


@rule
def bundle_swallows_backlog(job: Job) -> Finding | None:
    flink = job.streaming_flink
    bundle_size = (flink.max_bundle_size or 1000) if flink else 0  # Beam's Flink runner streaming default
    if bundle_size <= MAX_BARRIER_BUNDLE:
        return None
    return Finding(
        "bundle-swallows-backlog",
        "error",
        f"flink.max_bundle_size {bundle_size} lets a Python stage take in that many elements before a barrier",
        "every Python stage finishes its open bundle before it passes a checkpoint barrier on; on a backlog "
        "each stage's bundle fills to this size, so the barrier waits for all of it (issue 13: at 100,000 no "
        "checkpoint completed and the job restarted in a loop)",
        f"keep flink.max_bundle_size at or below {MAX_BARRIER_BUNDLE} (1,000 is Flink's streaming default)",
    )


@rule
def read_call_swallows_backlog(job: Job) -> Finding | None:
    read_call = job.config.kafka.max_bundle_records if job.config.kafka else 0
    if job.streaming_flink is None or read_call <= MAX_READ_CALL_RECORDS:
        return None
    return Finding(
        "read-call-swallows-backlog",
        "warning",
        f"kafka.max_bundle_records {read_call}: one read call emits that many records per partition",
        "the read stage passes a barrier only after what its call emitted has been handed downstream; on a "
        "backlog that output queues behind backpressure, and the barrier with it",
        f"keep kafka.max_bundle_records at or below {MAX_READ_CALL_RECORDS} (about a second of the job's "
        "per-subtask throughput)",
    )


def _bundle_ms(flink: FlinkConfig) -> int:
    return flink.max_bundle_time_ms or 1000  # Beam's Flink runner default


@rule
def read_polls_too_rarely(job: Job) -> Finding | None:
    flink = job.streaming_flink
    interval = flink.checkpointing_interval_ms if flink else None
    if not (flink and interval and _bundle_ms(flink) > interval // 2):
        return None
    return Finding(
        "read-polls-too-rarely",
        "warning",
        f"flink.max_bundle_time_ms {_bundle_ms(flink)} is over half the checkpoint interval",
        "Beam's Flink runner resumes a read only after the bundle that deferred it ends, so each partition is "
        "read once per bundle: throughput is capped at kafka.max_bundle_records per bundle time",
        "keep flink.max_bundle_time_ms near 1000 (barriers end bundles anyway)",
    )


@rule
def loopback_workers(job: Job) -> Finding | None:
    flink = job.streaming_flink
    environment = flink.environment if flink else None
    kind = str(environment.get("type", "LOOPBACK") if isinstance(environment, Mapping) else environment).upper()
    if flink is None or kind != "LOOPBACK":
        return None
    parallel = (flink.parallelism or 1) > 1
    return Finding(
        "loopback-workers",
        "warning" if parallel else "info",
        "the Python workers run inside the submitting process (LOOPBACK)",
        "every slot's Python shares one interpreter (one GIL) with the submitter, which must stay up: the "
        "job dies with it, and parallelism adds no Python throughput",
        "use environment: PROCESS (workers beside each TaskManager) or EXTERNAL worker pools",
    )


@rule
def per_event_state_round_trips(job: Job) -> Finding | None:
    if job.streaming_flink is None or job.config.dedup.strategy != "state":
        return None
    return Finding(
        "per-event-state-round-trips",
        "warning",
        "dedup.strategy state on a Flink stream",
        "on portable runners each per-key state read is a blocking round trip from the Python worker to the "
        "runner, one per event: the dedup stage then bounds the whole job's throughput (issue 13)",
        "use dedup.strategy: store (or auto), one PostgreSQL transaction per bundle",
    )


@rule
def no_tolerated_checkpoint_failures(job: Job) -> Finding | None:
    flink = job.streaming_flink
    if flink is None or flink.fail_on_checkpointing_errors is False or flink.tolerable_failed_checkpoints:
        return None
    return Finding(
        "no-tolerated-checkpoint-failures",
        "warning",
        "a single failed checkpoint restarts the job",
        "Beam's Flink runner tolerates no failed checkpoint by default: one slow checkpoint on a loaded "
        "machine restarts every task and re-reads from the last completed one",
        "set flink.tolerable_failed_checkpoints (e.g. 3) on the cluster",
    )


@rule
def iceberg_commit_per_bundle(job: Job) -> Finding | None:
    flink = job.streaming_flink
    interval = flink.checkpointing_interval_ms if flink else None
    if not (flink and job.config.iceberg and interval and _bundle_ms(flink) < interval):
        return None
    bundle_ms = _bundle_ms(flink)
    return Finding(
        "iceberg-commit-per-bundle",
        "info",
        f"Iceberg commits once per bundle (up to every {bundle_ms / 1000:g}s per subtask while data flows)",
        "WriteToIceberg commits in finish_bundle so the group's offsets never run ahead of the table; "
        "short bundles keep barriers fast but make small files and many snapshots (iceberg#2404)",
        "schedule `beamflow iceberg compact --sort-by event_time --row-group-rows 100000` (sorted in small row "
        "groups, the sink's key lookups by event time stay pruned; docs/deploying/iceberg-maintenance.yaml) and "
        "`beamflow iceberg expire` (or the sink's expire_keep_last)",
    )


KNOWN_KEYS_FLOOR = 100_000  # about a minute of a busy stream (1,500 events/s)


@rule
def known_keys_bound_small(job: Job) -> Finding | None:
    bound = job.config.iceberg.known_keys_max if job.config.iceberg else None
    if bound is None or bound >= KNOWN_KEYS_FLOOR:
        return None
    return Finding(
        "known-keys-bound-small",
        "warning",
        f"iceberg.known_keys_max is {bound:,}: under a minute of a busy stream's event ids",
        "each worker's Iceberg committer keeps the newest minutes' event ids, up to this bound, to tell new rows "
        "from replays; minutes dropped under it are scanned again when a batch needs them, so a bound under what "
        "a commit touches sends commits back to scanning the table, the stall the known keys exist to prevent "
        "(tests/flink/test_streaming_backlog.py with a bound of 1: 27 scans in 24 commits, against 4 in 12)",
        "keep a few minutes of traffic under it (the default 1,000,000 is 11 minutes at 1,500 events/s, about "
        "33 MB a worker), and the stream's lateness if memory allows (a late event's minute dropped under the bound "
        "is scanned again); `beamflow status` shows the scans (Iceberg key lookups that scanned the table)",
    )


@rule
def kafka_auto_commit(job: Job) -> Finding | None:
    # kafka.consumer_config is what pipelines/clicks.py hands to ReadFromKafka's consumer.
    consumer = job.config.kafka.consumer_config if job.config.kafka else {}
    if str(consumer.get("enable.auto.commit", consumer.get("enable_auto_commit", "false"))).lower() != "true":
        return None
    return Finding(
        "kafka-auto-commit",
        "error",
        "auto-commit enabled on the Kafka source",
        "offsets committed on a timer run ahead of what the sinks hold: a crash loses data (seed 003)",
        "remove enable.auto.commit; ReadFromKafka commits only from bundle finalizers",
    )


@rule
def consumer_fetch_spins(job: Job) -> Finding | None:
    consumer = job.config.kafka.consumer_config if job.config.kafka else {}
    backoff = consumer.get("fetch.queue.backoff.ms")
    if backoff is None or int(backoff) > 0:
        return None
    return Finding(
        "consumer-fetch-spins",
        "warning",
        "kafka.consumer_config sets fetch.queue.backoff.ms 0",
        "librdkafka then asks again at once whenever a partition's prefetch queue is full, which it is on any "
        "backlog larger than the queue: measured here, four consumers on a 400,000-record topic used 15.7 CPU "
        "seconds in 8 idle seconds (both cores), and the local clicks job 78 CPU s instead of 59 for the same work",
        "drop it (beamflow's default is 5 ms: reads as fast, benchmarks/kafka_read.py; the queue bounds are "
        "queued.min.messages and queued.max.messages.kbytes)",
    )


@rule
def local_processes_beyond_cores(job: Job) -> Finding | None:
    kafka, cores = job.config.kafka, os.cpu_count() or 1
    if kafka is None or kafka.local_processes <= cores:
        return None
    return Finding(
        "local-processes-beyond-cores",
        "warning",
        f"kafka.local_processes is {kafka.local_processes} on a machine with {cores} cores",
        "each process of a split local run runs the whole job on its own partitions and pays its own start (about "
        "2.6 CPU seconds) and working set; beyond one per core they only queue for the cores",
        f"set kafka.local_processes to at most {cores}",
    )


@rule
def split_run_with_runner_state_dedup(job: Job) -> Finding | None:
    kafka, dedup = job.config.kafka, job.config.dedup
    if kafka is None or kafka.local_processes < 2 or dedup is None or not dedup.in_runner_state:
        return None
    return Finding(
        "split-run-with-runner-state-dedup",
        "warning",
        f"kafka.local_processes {kafka.local_processes} with dedup.strategy {dedup.strategy}",
        "that strategy keeps the first copies in one process's runner state, where a process of a split local run "
        "cannot see another's; so the local run stays in one process",
        "use dedup.strategy auto (the first copies in PostgreSQL, shared by every process), or local_processes 1",
    )


@rule
def idleness_off(job: Job) -> Finding | None:
    if job.config.kafka is None or job.config.kafka.idle_timeout_ms is not None:
        return None
    return Finding(
        "idleness-off",
        "warning",
        "no idleness timeout on the Kafka source",
        "seed 002: one partition without data between 01:00 and 05:00 pinned the watermark and session "
        "windows stopped firing",
        "set kafka.idle_timeout_ms above the normal gap between records (see the live gap check)",
    )


@rule
def no_stable_sink_id(job: Job) -> Finding | None:
    if job.config.iceberg is None or job.config.iceberg.sink_id:
        return None
    return Finding(
        "no-stable-sink-id",
        "error",
        "the Iceberg sink has no sink_id",
        "exactly-once marks are keyed by the sink id; without a stable one a restart re-commits (iceberg#16008)",
        "set iceberg.sink_id to a fixed name",
    )


@rule
def unstable_sink_id(job: Job) -> Finding | None:
    sink_id = job.config.iceberg.sink_id if job.config.iceberg else None
    if not (sink_id and _RUN_ID.search(sink_id)):
        return None
    return Finding(
        "unstable-sink-id",
        "error",
        f"the Iceberg sink id {sink_id!r} looks like a run or job id",
        "a new id per run makes every restart a new writer: the committed marks are not found and data is added again",
        "use a fixed, human-chosen name",
    )


def _loopback_host(address: str) -> bool:
    host = address.strip().rsplit(":", 1)[0].strip("[]") if ":" in address else address.strip()
    return host in {"localhost", "127.0.0.1", "::1", "auto", ""} or host.startswith("127.")


@rule
def inline_password(job: Job) -> Finding | None:
    from beamflow.secrets import inline_kafka_secrets
    from beamflow.secrets import inline_password as dsn_has_password

    where: list[str] = []
    if job.config.postgres is not None and dsn_has_password(job.config.postgres.dsn):
        where.append("postgres.dsn")
    uri = job.config.iceberg.catalog.uri if job.config.iceberg else ""
    if uri.startswith("postgres") and dsn_has_password(uri.replace("+psycopg2", "").replace("+psycopg", "")):
        where.append("iceberg.catalog.uri")
    if job.config.kafka is not None:
        where += [f"kafka.consumer_config.{k}" for k in inline_kafka_secrets(job.config.kafka.consumer_config)]
    if job.config.kafka_sink is not None:
        producer = job.config.kafka_sink.producer_config
        where += [f"kafka_sink.producer_config.{k}" for k in inline_kafka_secrets(producer)]
    if not where:
        return None
    return Finding(
        "inline-password",
        "warning",
        f"a password is written in the config: {', '.join(where)}",
        "the DSN and client settings travel inside the pipeline (pickled DoFns, the job server, Flink's web UI and "
        "logs) and in every copy of the file",
        "refer to the secret by name: password=env:NAME or password=file:/path in the DSN, sasl.password: env:NAME "
        "(resolved where the connection opens, beamflow/secrets.py)",
    )


@rule
def plaintext_kafka(job: Job) -> Finding | None:
    clusters: list[tuple[str, str, dict[str, Any]]] = []
    if job.config.kafka is not None:
        clusters.append(("kafka", job.config.kafka.bootstrap, job.config.kafka.consumer_config))
    sink = job.config.kafka_sink
    if sink is not None and sink.bootstrap is not None:
        clusters.append(("kafka_sink", sink.bootstrap, sink.producer_config))
    plain = [
        f"{section}.bootstrap {bootstrap}"
        for section, bootstrap, settings in clusters
        if str(settings.get("security.protocol", settings.get("security_protocol", "PLAINTEXT"))).upper()
        in {"PLAINTEXT", "SASL_PLAINTEXT"}
        and not all(_loopback_host(address) for address in bootstrap.split(","))
    ]
    if not plain:
        return None
    return Finding(
        "plaintext-kafka",
        "warning",
        f"Kafka over an unencrypted connection to another host: {', '.join(plain)}",
        "records, offsets and any SASL password cross the network in the clear; anyone on the path reads or "
        "alters them",
        "set security.protocol: SASL_SSL (with sasl.mechanism SCRAM-SHA-512 and sasl.password: env:NAME) in "
        "kafka.consumer_config (and kafka_sink.producer_config)",
    )


def rule_code(fn: Rule) -> str:
    """The finding code a rule produces: its function name with dashes."""
    return fn.__name__.replace("_", "-")


def check_config(config: JobConfig | Mapping[str, Any], partitions: int | None = None) -> list[Finding]:
    """Static findings for a job config (``conf/*.yaml`` after overrides): every rule of ``RULES`` in order.
    ``partitions`` (the topic's live count) overrides ``kafka.partitions``."""
    typed = as_job_config(config)
    if partitions is None and typed.kafka is not None:
        partitions = typed.kafka.partitions
    job = Job(typed, partitions)
    return [finding for check in RULES if (finding := check(job)) is not None]


def check_unstable_names(labels: list[str]) -> list[Finding]:
    """Transform labels that will change between builds break savepoint restore (operator ids come from them)."""
    # Lambdas inside Beam's own composites (e.g. Create's expansion in core.py) change only with a Beam upgrade,
    # which needs a savepoint migration anyway; user code is what must carry explicit labels.
    unstable = [
        label
        for label in labels
        if re.search(r"<lambda>|at 0x[0-9a-f]+|\.py:\d+|\[\d+\]$", label)
        and not re.search(r"<lambda at (core|util|combiners|ptransform)\.py:\d+>\)$", label)
    ]
    if not unstable:
        return []
    return [
        Finding(
            "unstable-operator-names",
            "error",
            f"{len(unstable)} transforms have generated names, e.g. {unstable[0]!r}",
            "seed 000 question 3: savepoint restore matches operators by stable ids; Beam derives them from "
            "transform labels, and generated labels change when code moves",
            "give every transform an explicit label: 'Name' >> transform",
        )
    ]


def check_record_gaps(gaps_ms: Mapping[int, int], idle_timeout_ms: int | None) -> list[Finding]:
    """``gaps_ms``: per partition, the largest gap between consecutive record timestamps in a recent sample."""
    if idle_timeout_ms is None or not gaps_ms:
        return []
    worst_partition, worst = max(gaps_ms.items(), key=lambda kv: kv[1])
    if worst <= idle_timeout_ms:
        return []
    return [
        Finding(
            "idleness-shorter-than-gap",
            "warning",
            f"idle timeout {idle_timeout_ms} ms is shorter than the normal gap between records ({worst} ms on "
            f"partition {worst_partition})",
            "seed 002 question 3: a partition marked idle during a normal pause lets the watermark pass records "
            "that are then late for windows that already fired",
            f"raise kafka.idle_timeout_ms above {worst} ms, or send heartbeats on quiet partitions",
        )
    ]


def check_sink_timestamps(
    topic: str, settings: Mapping[str, str], timestamps: str, oldest_unread: int | None, now_ms: int
) -> list[Finding]:
    """``settings``: the sink topic's configuration; ``oldest_unread``: the Kafka timestamp (ms) of the oldest record
    the job has yet to read (``oldest_unread_ms``). Warns when the results of that backlog, stamped with their event
    times, are older than the sink topic keeps: ``WriteToKafka`` dead-letters them (Kafka would delete them)."""
    from beamflow.kafka.producer import topic_limits

    if timestamps != "event-time" or oldest_unread is None:
        return []
    # The sink's own reading of the topic's rules, so doctor warns of exactly what WriteToKafka will refuse.
    retention = topic_limits(settings, {}, "doctor").retention_ms
    if retention is None:
        return []
    age = now_ms - oldest_unread
    if age <= retention:
        return []
    return [
        Finding(
            "sink-timestamps-beyond-retention",
            "warning",
            f"the job's oldest unread record is {age / 3_600_000:.1f} h old and the sink topic {topic} keeps "
            f"{retention / 3_600_000:.1f} h (retention.ms): results stamped with those events' times go to dead "
            "letters",
            "Kafka deletes a closed segment whose newest timestamp is past retention.ms, so results of a replay or "
            "backfill stamped with old event times would vanish within minutes; WriteToKafka refuses them "
            "(TIMESTAMP_BEYOND_RETENTION) instead of losing them silently",
            f"for the backfill set kafka_sink.timestamps: producer (stamped when written), or raise {topic}'s "
            "retention.ms above the backlog's age",
        )
    ]


def check_checkpoint_stats(stats: Mapping[str, Any], interval_ms: int | None) -> list[Finding]:
    """Reads Flink's ``/jobs/<id>/checkpoints`` answer: says which phase dominates (seed 002, question 1)."""
    findings: list[Finding] = []
    latest = (stats.get("latest") or {}).get("completed") or {}
    summary = stats.get("summary") or {}
    duration = latest.get("end_to_end_duration")
    if duration is None:
        duration = (summary.get("end_to_end_duration") or {}).get("max")
    if duration is None:
        return [
            Finding(
                "no-checkpoints",
                "warning",
                "no completed checkpoint yet",
                "nothing is finalized or committed until one completes",
                "check checkpointing and the job's health",
            )
        ]
    alignment = (summary.get("alignment_buffered") or {}).get("max", 0)
    sync = (summary.get("checkpointed_size") or {}).get("max", 0)
    phases = {
        "alignment": _phase(summary, "checkpoint_start_delay") + _phase(summary, "alignment_duration"),
        "sync snapshot": _phase(summary, "sync_duration"),
        "async upload": _phase(summary, "async_duration"),
    }
    dominant = max(phases, key=lambda k: phases[k])
    msg = (
        f"latest checkpoint took {duration} ms; phases (max ms): "
        + ", ".join(f"{k} {v}" for k, v in phases.items())
        + f"; state size {sync} bytes, buffered during alignment {alignment} bytes"
    )
    severity = "warning" if interval_ms and duration > interval_ms else "info"
    fixes = {
        "alignment": "backpressure: speed up the slowest operator (batch sink writes, e.g. BufferedMutator-style "
        "flushes), then consider unaligned checkpoints",
        "sync snapshot": "large synchronous snapshots: check state backend memory (RocksDB block cache, buffers)",
        "async upload": "state upload dominates: incremental RocksDB checkpoints, smaller state (TTL, bounded "
        "sessions, pre-aggregation)",
    }
    findings.append(
        Finding(
            f"checkpoint-{dominant.replace(' ', '-')}",
            severity,
            msg,
            f"{dominant} dominates checkpoint time",
            fixes[dominant],
        )
    )
    return findings


# Measured by benchmarks/soak.py on Beam 2.62's own runner (clicks job, 2 partitions, 100 records/s, parallelism 2,
# 10 s checkpoints): the checkpoint grew from 0.97 MB at minute 2 to 6.03 MB at minute 10, linearly, almost all of it
# in the read's stages.
SDF_RESIDUAL_MB_PER_PARTITION_MINUTE = 0.32


def check_flink_classpath(classpath: list[str], partitions: int | None) -> list[Finding]:
    """Reads a cluster's classpath (``/jobmanager/environment``): is Beam's runner patched against apache/beam#27648
    (``beamflow.services.beam_patches``'s jar ahead of Beam's runner jar), or does a streaming read's state grow?"""
    names = [entry.rsplit("/", 1)[-1] for entry in classpath]
    runner = next((i for i, name in enumerate(names) if name.startswith("beam-runners-flink")), None)
    patched = next((i for i, name in enumerate(names) if name == SDF_RESIDUALS_JAR), None)
    if runner is None or (patched is not None and patched < runner):
        return []  # Beam not on the cluster's classpath (jobs ship it: nothing to say from here), or patched
    per_day_mb = SDF_RESIDUAL_MB_PER_PARTITION_MINUTE * (partitions or 1) * 60 * 24
    where = "is missing" if patched is None else "comes after Beam's runner jar"
    return [
        Finding(
            "sdf-residual-state-grows",
            "warning",
            f"the streaming read's checkpoint state grows without bound on this cluster (about {per_day_mb:,.0f} MB "
            f"a day at {partitions or 1} partitions): {SDF_RESIDUALS_JAR} {where} on its classpath",
            "Beam 2.62's portable Flink runner keeps every residual a splittable DoFn defers in a keyed value state "
            "of its own and never clears it (apache/beam#27648, fixed upstream after 2.62 by apache/beam#39191); "
            "each read call of each partition leaves one behind; the same jar keeps a bundle that a checkpoint "
            "barrier finished from being overtaken by the watermark (without it a streaming read can start and "
            "never read, and on-time records can arrive late at a window), and gives the read's Impulse one "
            "operator id at any parallelism (without it a savepoint does not restore across parallelism 1, and "
            "skipping its state hands every partition out twice)",
            f"put {SDF_RESIDUALS_JAR} (FlinkService.sdf_residuals_jar(), built by `beamflow services up flink`) in the "
            "cluster's lib/ and on the job server's classpath, both ahead of Beam's jars (docs/deploying.md)",
        )
    ]


# What the soak measured without a MANIFEST bound: about 1.4 KB more per checkpoint per keyed RocksDB instance.
MANIFEST_KB_PER_CHECKPOINT = 1.4
_OPTIONS_FACTORY_KEY = "state.backend.rocksdb.options-factory"


def check_flink_state_config(config: Mapping[str, str], interval_ms: int | None) -> list[Finding]:
    """Reads a cluster's configuration (``/jobmanager/config``): with RocksDB state, is each instance's MANIFEST
    bounded (``rocksdb_max_manifest_bytes``), or does every incremental checkpoint upload a longer one?"""
    if str(config.get("state.backend.type", config.get("state.backend", ""))).lower() != "rocksdb":
        return []
    if config.get(_OPTIONS_FACTORY_KEY):
        return []  # beamflow's factory or the owner's own: their choice is visible, nothing to guess
    return [_manifest_grows("on this cluster", interval_ms)]


def _manifest_grows(where: str, interval_ms: int | None) -> Finding:
    per_day_mb = MANIFEST_KB_PER_CHECKPOINT * 86_400_000 / (interval_ms or 10_000) / 1024
    return Finding(
        "rocksdb-manifest-grows",
        "warning",
        f"each RocksDB instance's MANIFEST grows with every checkpoint {where} (about {per_day_mb:,.0f} MB a day per "
        "keyed operator instance, uploaded whole with every incremental checkpoint)",
        "RocksDB appends a version edit per flush and rolls the MANIFEST over only at max_manifest_file_size "
        "(1 GB by default, never set by Flink 1.19); Flink flushes at every checkpoint and uploads the MANIFEST as "
        "private state each time (ververica/frocksdb#87)",
        "set flink.rocksdb_max_manifest_bytes (conf/flink.yaml: 16384) with beamflow's RocksDB options jar in the "
        "cluster's lib/ (FlinkService.rocksdb_options_jar(); docs/deploying.md)",
    )


def _phase(summary: Mapping[str, Any], name: str) -> int:
    value = (summary.get(name) or {}).get("max", 0)
    return int(value or 0)


def format_findings(findings: list[Finding], out: Callable[[str], None] = print) -> None:
    if not findings:
        out("doctor: no findings")
        return
    for f in findings:
        out(f"[{f.severity}] {f.code}: {f.message}")
        out(f"    why: {f.why}")
        out(f"    fix: {f.fix}")


def sample_record_gaps(
    bootstrap: str, topic: str, per_partition: int = 500, config: Mapping[str, Any] | None = None
) -> dict[int, int]:
    """The largest gap (ms) between consecutive record timestamps among each partition's newest records
    (``config``: the job's consumer settings; its connection and security ones are used)."""
    from beamflow.kafka.admin import connection_settings
    from beamflow.kafka.client import open_consumer
    from beamflow.kafka.record import TopicPartition

    settings = connection_settings(config)
    consumer = open_consumer("confluent", bootstrap, "beamflow-doctor", settings)
    gaps: dict[int, int] = {}
    try:
        for partition in consumer.partitions(topic):
            tp = TopicPartition(topic, partition)
            low, high = consumer.watermarks(tp)
            start = max(low, high - per_partition)
            if high - start < 2:
                continue
            probe = open_consumer("confluent", bootstrap, "beamflow-doctor", settings)
            try:
                probe.assign(tp, start)
                stamps: list[int] = []
                for _ in range(50):
                    stamps += [r.timestamp_ms for r in probe.poll(per_partition, 0.2) if r.partition == partition]
                    if len(stamps) >= high - start:
                        break
            finally:
                probe.close()
            stamps.sort()
            gaps[partition] = max((b - a for a, b in itertools.pairwise(stamps)), default=0)
    finally:
        consumer.close()
    return gaps


def oldest_unread_ms(
    bootstrap: str, topic: str, group_id: str, start: str = "earliest", config: Mapping[str, Any] | None = None
) -> int | None:
    """The smallest Kafka timestamp among the records ``group_id`` reads next (each partition's record at its
    committed offset; without one, at the start policy's end), None when the group has read everything. The group's
    offsets are only read: the probe assigns partitions, joins no group and commits nothing."""
    from beamflow.kafka.admin import connection_settings
    from beamflow.kafka.client import open_consumer
    from beamflow.kafka.record import TopicPartition

    settings = connection_settings(config)
    consumer = open_consumer("confluent", bootstrap, group_id, settings)
    oldest: int | None = None
    try:
        for partition in consumer.partitions(topic):
            tp = TopicPartition(topic, partition)
            low, high = consumer.watermarks(tp)
            committed = consumer.committed(tp)
            position = max(committed, low) if committed is not None else (low if start == "earliest" else high)
            if position >= high:
                continue
            probe = open_consumer("confluent", bootstrap, "beamflow-doctor", settings)
            try:
                probe.assign(tp, position)
                for _ in range(50):
                    records = [r for r in probe.poll(1, 0.2) if r.partition == partition]
                    if records:
                        stamp = records[0].timestamp_ms
                        oldest = stamp if oldest is None else min(oldest, stamp)
                        break
            finally:
                probe.close()
    finally:
        consumer.close()
    return oldest


def pipeline_labels(build: Callable[[Any], Any]) -> list[str]:
    """Full labels of every transform ``build(pipeline)`` applies (nothing runs)."""
    import apache_beam as beam
    from apache_beam.pipeline import PipelineVisitor

    labels: list[str] = []

    class _Collect(PipelineVisitor):
        def enter_composite_transform(self, node: Any) -> None:
            if node.full_label:
                labels.append(node.full_label)

        def visit_transform(self, node: Any) -> None:
            labels.append(node.full_label)

    p = beam.Pipeline(runner="DirectRunner")  # only constructed, never run
    build(p)
    p.visit(_Collect())
    return labels
