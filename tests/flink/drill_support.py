"""Failure drills for the clicks job on the real local Flink cluster: submit, feed, disrupt, sample, audit.

Each job instance is submitted by its own process (``python -m pipelines.clicks --runner=FlinkRunner``, detached) in the
production shape: parallelism 2 over two TaskManagers, each starting its own Python workers (PROCESS), so killing a
TaskManager kills its workers, and two instances of the same job (the zombie drill) do not share a Python worker.
The test process produces traffic, samples the consumer group's
committed offsets against what the sinks hold, and audits the sinks at the end.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from beamflow.config import load_config
from beamflow.flink_rest import TERMINAL_STATES, FlinkRest
from beamflow.generate import ClickRecord, GeneratedTraffic, TrafficSpec, avro_click_encoder, generate_traffic
from beamflow.services import ServiceState
from beamflow.services.flink import python_workers
from beamflow.services.paths import project_root

__all__ = [
    "KILL_MOMENTS",
    "DrillJob",
    "OffsetSampler",
    "TrafficFeeder",
    "drill_config",
    "job_blobs",
    "latest_retained_checkpoint",
    "python_workers",
    "sink_holdings",
    "wait_for_kill_moment",
    "wait_for_sinks",
]

ROOT = project_root()


def drill_config(
    name: str,
    kafka: ServiceState,
    postgres: ServiceState,
    registry: ServiceState,
    flink: ServiceState,
    data_dir: Path,
    **flink_overrides: Any,
) -> dict[str, Any]:
    """The clicks job's configuration with a unique topic, group, tables and sink id, streaming on the local cluster."""
    run = f"{name}_{uuid.uuid4().hex[:6]}"
    config = load_config(ROOT / "conf" / "clicks.yaml")
    config["job"]["name"] = run
    config["kafka"].update(
        bootstrap=kafka.info["bootstrap"],
        topic=f"drill-{run}",
        group_id=f"drill-{run}",
        partitions=2,
        bounded=False,
        max_delay_ms=2000,
        idle_timeout_ms=5000,
    )
    config["registry"].update(url=registry.info["url"], subject=f"drill-{run}-value")
    config["postgres"].update(
        dsn=postgres.info["dsn"],
        sessions_table=f"sessions_{run}",
        dead_letters_table=f"dead_{run}",
        quarantine_table=f"quarantine_{run}",
    )
    warehouse = data_dir / "iceberg" / "warehouse"
    warehouse.mkdir(parents=True, exist_ok=True)
    config["iceberg"].update(
        catalog={"uri": f"sqlite:///{data_dir / 'iceberg' / 'catalog.db'}", "warehouse": f"file://{warehouse}"},
        table=f"drills.impressions_{run}",
        sink_id=f"drill-{run}".replace("_", "-"),
    )
    # Sessions close 20 s of event time after a user's last click, so they are written while the drill runs.
    config["sessions"].update(gap_s=20)
    settings: dict[str, Any] = {
        "job_endpoint": flink.info["job_endpoint"],
        "rest_url": flink.info["rest_url"],
        # The production shape: Python workers beside each TaskManager, one subtask per TaskManager.
        "environment": {"type": "PROCESS", "command": flink.info["boot"]},
        "files_to_stage": [flink.info["marker_jar"]],
        "parallelism": 2,
        "checkpointing_interval_ms": 3000,
        "max_bundle_time_ms": 3000,
        "min_pause_between_checkpoints_ms": 1000,
        "checkpoint_timeout_ms": 60000,
        "retained_checkpoints": True,
        "restart_strategy": {"type": "fixed-delay", "attempts": 20, "delay_ms": 2000},
    }
    config["flink"].update({**settings, **flink_overrides})
    return config


def traffic_for(config: dict[str, Any], events: int, seed: int, v2_from: float | None = None) -> GeneratedTraffic:
    spec = TrafficSpec(
        events=events,
        users=200,
        partitions=int(config["kafka"]["partitions"]),
        duplicate_share=0.05,
        bad_per_kind=2,
        idle_partition=None,
        v2_from=v2_from,
        seed=seed,
    )
    return generate_traffic(spec, avro_click_encoder(config["registry"]["url"], config["registry"]["subject"]))


class DrillJob:
    """One submission of the clicks job in its own process; ``job_id`` is found through Flink REST by job name."""

    def __init__(
        self,
        config: dict[str, Any],
        work_dir: Path,
        label: str,
        extra_args: tuple[str, ...] = (),
        module: str = "pipelines.clicks",
    ) -> None:
        self.module = module  # tests.flink.broken_clicks: the variant the holdings check must catch
        self.config = json.loads(json.dumps(config))
        self.job_name = f"{config['job']['name']}-{label}"
        self.config["flink"]["job_name"] = self.job_name
        self.rest = FlinkRest(_rest_url(config))
        work_dir.mkdir(parents=True, exist_ok=True)
        self.conf_path = work_dir / f"{label}.yaml"
        self.conf_path.write_text(yaml.safe_dump(self.config))
        self.log_path = work_dir / f"{label}.log"
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.job_id: str | None = None
        self.submitted_s = 0.0

    def start(self, timeout: float = 240) -> DrillJob:
        started = time.monotonic()
        argv = [sys.executable, "-m", self.module, "--runner=FlinkRunner", f"--conf={self.conf_path}"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*argv, *self.extra_args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while self.job_id is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.job_name} not submitted after {timeout}s; see {self.log_path}")
            if self.proc.poll() not in (None, 0):  # a detached submitter exits 0 once Flink runs the job
                raise AssertionError(f"{self.job_name} submitter exited {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(Exception):
                for job in self.rest.jobs():
                    if job.name == self.job_name and job.state not in TERMINAL_STATES:
                        self.job_id = job.job_id
            time.sleep(1)
        self.rest.wait_for_state(self.job_id, {"RUNNING"}, timeout=120)
        self.submitted_s = time.monotonic() - started
        return self

    @property
    def parallelism(self) -> int:
        """The parallelism Flink runs the job at (its widest vertex), read from REST, not from the config."""
        assert self.job_id
        return max(int(v["parallelism"]) for v in self.rest.job(self.job_id)["vertices"])

    def wait_for_checkpoints(self, more: int = 1, timeout: float = 120) -> int:
        assert self.job_id
        done = self.rest.completed_checkpoints(self.job_id)
        try:
            return self.rest.wait_for_checkpoints(self.job_id, done + more, timeout)
        except Exception as exc:
            raise AssertionError(f"{exc}\n{self.diagnosis()}") from exc

    def cancel(self) -> None:
        if self.job_id:
            with contextlib.suppress(Exception):
                if self.rest.job_state(self.job_id) not in TERMINAL_STATES:
                    self.rest.cancel(self.job_id)
                    self.rest.wait_for_state(self.job_id, {"CANCELED"}, timeout=60)
        self.reap()

    def reap(self, timeout: float = 30) -> None:
        """Ends the submitter process (its LOOPBACK workers with it)."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def diagnosis(self) -> str:
        """What a stuck job looks like from outside: its tasks, their record counts, exceptions, the submitter's log."""
        lines = [f"job {self.job_name} ({self.job_id})"]
        with contextlib.suppress(Exception):
            assert self.job_id
            job = self.rest.job(self.job_id)
            lines.append(f"state {job.get('state')}")
            for vertex in job.get("vertices", []):
                metrics = vertex.get("metrics", {})
                lines.append(
                    f"  {vertex.get('status'):>10} {vertex.get('tasks')} read={metrics.get('read-records')} "
                    f"written={metrics.get('write-records')} {vertex.get('name', '')[:100]}"
                )
            exceptions = self.rest.job_exceptions(self.job_id)
            lines.append(f"exceptions {json.dumps(exceptions)[:1500]}")
        with contextlib.suppress(Exception):
            slots = [(t.get("id"), t.get("freeSlots"), t.get("slotsNumber")) for t in self.rest.taskmanagers()]
            lines.append(f"taskmanagers (id, free slots, slots) {slots}")
        lines.append(f"submitter log:\n{self.log_tail(4000)}")
        return "\n".join(lines)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def taskmanager_role_running(rest: FlinkRest, job_id: str) -> str:
    """The FlinkService role (``taskmanager``, ``taskmanager-2``, ...) of a TaskManager that runs tasks of the job,
    so a drill kills one that matters (resource ids are ``taskmanager-<index>-<suffix>``)."""
    vertex = rest.job(job_id)["vertices"][-1]["id"]
    hosts = rest._request("GET", f"/jobs/{job_id}/vertices/{vertex}/taskmanagers")["taskmanagers"]
    index = int(str(hosts[0]["taskmanager-id"]).split("-")[1])
    return "taskmanager" if index == 1 else f"taskmanager-{index}"


def job_blobs(flink: ServiceState, job_id: str) -> dict[str, list[int]]:
    """The sizes of a job's blobs in each of the cluster's blob stores (store folder -> sizes, largest first).

    A job's permanent blobs are the jars it shipped (and Flink's offloaded job or task information, which a small job
    does not need): the JobManager stores them at submission, each TaskManager that runs a task of the job downloads
    them into its own store, all under ``blob.storage.directory`` (``<data>/flink/tmp/blob``). Read while the job runs:
    the stores delete a job's blobs once it ends.
    """
    root = Path(flink.info["conf_dir"]).parent / "tmp" / "blob"
    found: dict[str, list[int]] = {}
    for folder in root.glob(f"blobStore-*/job_{job_id}"):
        sizes = []
        for blob in folder.iterdir():
            with contextlib.suppress(OSError):  # a store may be deleting it
                sizes.append(blob.stat().st_size)
        found[folder.parent.name] = sorted(sizes, reverse=True)
    return found


def _rest_url(config: dict[str, Any]) -> str:
    return str(config["flink"]["rest_url"])


class TrafficFeeder(threading.Thread):
    """Produces generated records in ``chunks`` slices, ``pause_s`` apart, while the job runs."""

    def __init__(self, config: dict[str, Any], records: list[ClickRecord], chunks: int, pause_s: float) -> None:
        super().__init__(daemon=True)
        self.config = config
        self.records = records
        self.chunks = chunks
        self.pause_s = pause_s
        self.sent = 0
        self.error: BaseException | None = None
        self._resume = threading.Event()
        self._resume.set()
        self._holds: list[float] = []
        self.held = threading.Event()  # set while the feeder waits at a hold

    def pause(self) -> None:
        self._resume.clear()

    def resume(self) -> None:
        self.held.clear()
        self._resume.set()

    def hold_at(self, *shares: float) -> None:
        """Pause by itself once ``share`` of the records are sent, until ``resume``: a fault applied at a hold
        always has traffic still to come, however long the faults before it took on a loaded machine (a time-paced
        feeder had sent everything before the third fault of a drill at load average 25)."""
        self._holds = sorted(shares)

    def wait_held(self, timeout: float = 300) -> None:
        if not self.held.wait(timeout):
            raise AssertionError(f"the feeder never reached its hold ({self.sent} sent, error {self.error})")

    def run(self) -> None:
        from beamflow.kafka.admin import produce

        size = -(-len(self.records) // self.chunks)
        try:
            for start in range(0, len(self.records), size):
                if self._holds and start >= self._holds[0] * len(self.records):
                    self._holds.pop(0)
                    self._resume.clear()
                    self.held.set()
                self._resume.wait()
                chunk = self.records[start : start + size]
                for attempt in range(30):  # the broker-restart drill takes the broker away for a while
                    try:
                        produce(
                            self.config["kafka"]["bootstrap"],
                            self.config["kafka"]["topic"],
                            (
                                (r.key, r.value, {"partition": r.partition, "timestamp_ms": r.timestamp_ms})
                                for r in chunk
                            ),
                        )
                        break
                    except Exception:
                        if attempt == 29:
                            raise
                        time.sleep(2)
                self.sent += len(chunk)
                time.sleep(self.pause_s)
        except BaseException as exc:  # reported by the test
            self.error = exc


def sink_holdings(config: dict[str, Any]) -> dict[int, int]:
    """Per partition, the highest offset below which the sinks account for EVERY offset (a contiguous prefix).

    Accounted for: an Iceberg row, a quarantined duplicate or a dead letter at that coordinate. A maximum would not
    do: sinks fed by shuffled batches can hold offset 500 while 480 is still missing, and a commit past 480 then
    loses it on a restart from the group's offsets. Returns the last offset of the prefix (-1: none).
    """
    held = accounted_offsets(config)  # a sink that cannot be read raises: the sampler skips that sample
    return {p: first - 1 for p, first in contiguous_prefix(held["iceberg"] + held["dead"] + held["quarantine"]).items()}


def contiguous_prefix(coordinates: list[tuple[int, int]]) -> dict[int, int]:
    """Per partition, the first offset (from 0) that no coordinate covers."""
    by_partition: dict[int, set[int]] = defaultdict(set)
    for partition, offset in coordinates:
        by_partition[int(partition)].add(int(offset))
    out = {}
    for partition, offsets in by_partition.items():
        first = 0
        while first in offsets:
            first += 1
        out[partition] = first
    return out


def committed_offsets(config: dict[str, Any]) -> dict[int, int]:
    """The consumer group's committed offsets (next offset to read) per partition; absent = nothing committed."""
    from confluent_kafka import Consumer, TopicPartition

    kafka = config["kafka"]
    consumer = Consumer(
        {"bootstrap.servers": kafka["bootstrap"], "group.id": kafka["group_id"], "enable.auto.commit": False}
    )
    try:
        parts = [TopicPartition(kafka["topic"], p) for p in range(int(kafka["partitions"]))]
        return {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=10) if tp.offset >= 0}
    finally:
        consumer.close()


@dataclass
class OffsetSample:
    at_s: float
    committed: dict[int, int]
    held: dict[int, int]

    def ahead(self) -> dict[int, tuple[int, int]]:
        """Partitions whose committed offset is past what the sinks hold: partition -> (committed, held + 1)."""
        return {p: (c, self.held.get(p, -1) + 1) for p, c in self.committed.items() if c > self.held.get(p, -1) + 1}


class OffsetSampler(threading.Thread):
    """Samples committed offsets, then (strictly after) the sinks: a commit ahead of the sinks is a loss risk."""

    def __init__(self, config: dict[str, Any], interval_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.config = config
        self.interval_s = interval_s
        self.samples: list[OffsetSample] = []
        self.errors: list[str] = []
        self._stop_event = threading.Event()
        self._t0 = time.monotonic()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        try:
            committed = committed_offsets(self.config)
            held = sink_holdings(self.config)
            self.samples.append(OffsetSample(round(time.monotonic() - self._t0, 1), committed, held))
        except Exception as exc:  # the broker may be down in a drill
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def finish(self) -> list[OffsetSample]:
        self._stop_event.set()
        self.join(30)
        self.sample()
        return self.samples

    def violations(self) -> list[OffsetSample]:
        return [s for s in self.samples if s.ahead()]


def accounted_offsets(config: dict[str, Any]) -> dict[str, Any]:
    """Every Kafka coordinate the sinks hold, by sink: Iceberg rows, dead letters, quarantined duplicates."""
    import psycopg
    from psycopg import sql
    from pyiceberg.exceptions import NoSuchTableError

    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    ice = config["iceberg"]
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"]["uri"]))
    out: dict[str, Any] = {"iceberg": [], "event_ids": []}
    # Only a table that does not exist yet (it appears with the first commit) counts as holding nothing. Any other
    # failure (PostgreSQL restarting in a drill, say) must not read as "the sinks hold nothing": that made a sample
    # taken during the PostgreSQL restart look like a commit ahead of the sinks.
    with contextlib.suppress(NoSuchTableError):
        table = catalog.load_table(ice["table"]).scan(selected_fields=("partition", "offset", "event_id")).to_arrow()
        out["iceberg"] = list(zip(table["partition"].to_pylist(), table["offset"].to_pylist(), strict=True))
        out["event_ids"] = table["event_id"].to_pylist()
    pg = config["postgres"]
    with psycopg.connect(pg["dsn"], autocommit=True) as conn:
        for name, key in (("dead", "dead_letters_table"), ("quarantine", "quarantine_table")):
            out[name] = []
            with contextlib.suppress(psycopg.errors.UndefinedTable):
                rows = conn.execute(
                    sql.SQL("SELECT kafka_partition, kafka_offset FROM {} WHERE kafka_offset IS NOT NULL").format(
                        sql.Identifier(pg[key])
                    )
                ).fetchall()
                out[name] = [(int(p), int(o)) for p, o in rows]
    return out


def sink_counts(config: dict[str, Any]) -> dict[str, int]:
    """Distinct Iceberg event ids, dead letters and quarantined records now (0 for a table not created yet).

    The row counts are ``beamflow status``'s own (``sink_totals``); the distinct ids are a scan, which status does not
    pay for.
    """
    from beamflow.cli.status import sink_totals
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    totals = sink_totals(config)
    out = {"iceberg_distinct_ids": 0, "dead_letters": totals.get("dead_letters", 0)}
    out["quarantined"] = totals.get("quarantined", 0)
    ice = config["iceberg"]
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"]["uri"]))
    with contextlib.suppress(Exception):  # no table before the first commit
        ids = catalog.load_table(ice["table"]).scan(selected_fields=("event_id",)).to_arrow()["event_id"]
        out["iceberg_distinct_ids"] = len(set(ids.to_pylist()))
    return out


def wait_for_sinks(config: dict[str, Any], traffic: GeneratedTraffic, timeout: float = 180) -> dict[str, int]:
    """Polls the sinks until they hold every produced record (or the timeout); returns the last counts."""
    deadline = time.monotonic() + timeout
    want = (traffic.counts["events"], traffic.counts["bad_records"], traffic.counts["duplicate_sends"])
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        counts = sink_counts(config)
        if (counts["iceberg_distinct_ids"], counts["dead_letters"], counts["quarantined"]) >= want:
            return counts
        time.sleep(3)
    return counts


# When a kill drill strikes, relative to the job's checkpoints (issue 17: "at least three moments ... including around a
# checkpoint"): anywhere in the stream; at once after a checkpoint completed (the sinks' writes since then are in no
# checkpoint yet: the restore replays them into the sinks' replay checks); while a checkpoint is in flight (its
# barrier between the stages: the restore goes back to the one before).
KILL_MOMENTS = ("mid-stream", "after a checkpoint completed", "during a checkpoint")


def _checkpoint_folders(checkpoints_dir: Path, job_id: str) -> tuple[int, list[int]]:
    """(newest complete checkpoint number, numbers of the folders still without ``_metadata``)."""
    complete, open_ = 0, []
    for folder in (checkpoints_dir / job_id).glob("chk-*"):
        number = int(folder.name.split("-")[1])
        if (folder / "_metadata").exists():
            complete = max(complete, number)
        else:
            open_.append(number)
    return complete, [n for n in open_ if n > complete]


def wait_for_kill_moment(checkpoints_dir: Path, job_id: str, moment: str, timeout: float = 180) -> dict[str, Any]:
    """Returns as soon as the job is at ``moment`` (one of ``KILL_MOMENTS``), with what was seen.

    Read from the checkpoint storage, not Flink REST (whose checkpoint statistics are cached for
    ``rest.cache.checkpoint-statistics.timeout``, 3 s by default: a checkpoint can start and end unseen): the
    JobManager creates ``chk-N`` when it triggers checkpoint N and writes ``chk-N/_metadata`` when N completes.
    """
    if moment not in KILL_MOMENTS:
        raise ValueError(f"moment must be one of {KILL_MOMENTS}, not {moment!r}")
    first_complete, _ = _checkpoint_folders(checkpoints_dir, job_id)
    if moment == "mid-stream":
        return {"moment": moment, "newest_complete": first_complete}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        complete, in_flight = _checkpoint_folders(checkpoints_dir, job_id)
        if moment == "after a checkpoint completed" and complete > first_complete:
            return {"moment": moment, "newest_complete": complete}
        if moment == "during a checkpoint" and in_flight:
            return {"moment": moment, "newest_complete": complete, "in_flight": min(in_flight)}
        time.sleep(0.005)
    raise AssertionError(f"job {job_id} never reached the moment {moment!r} in {timeout:.0f}s")


def partition_owners(rest: FlinkRest, job_id: str, topic: str, partitions: int, timeout: float) -> dict[int, set[int]]:
    """Which partitions each read subtask has read (``FlinkRest.partitions_read_by_subtask``), asked again until
    all ``partitions`` show up or ``timeout`` passes: the JobManager refreshes REST metrics asynchronously (at most
    every 10 s, after a request asks), so a first answer can predate the read's counters. Returns what was seen."""
    deadline = time.monotonic() + timeout
    while True:
        owners = rest.partitions_read_by_subtask(job_id, topic)
        if set().union(set(), *owners.values()) >= set(range(partitions)) or time.monotonic() > deadline:
            return owners
        time.sleep(2)


def latest_retained_checkpoint(checkpoints_dir: Path, job_id: str) -> str:
    """The newest ``chk-N`` folder of a job that has its ``_metadata`` (a complete, restorable checkpoint)."""
    folders = [p for p in (checkpoints_dir / job_id).glob("chk-*") if (p / "_metadata").exists()]
    if not folders:
        raise AssertionError(f"no retained checkpoint with _metadata under {checkpoints_dir / job_id}")
    return str(max(folders, key=lambda p: int(p.name.split("-")[1])))


def expected_coordinates(traffic: GeneratedTraffic) -> dict[str, set[tuple[int, int]]]:
    """Where each produced record landed in Kafka (records of a partition get consecutive offsets from 0)."""
    next_offset: dict[int, int] = defaultdict(int)
    out: dict[str, set[tuple[int, int]]] = {"event": set(), "duplicate": set(), "bad": set()}
    for record in traffic.records:
        coordinate = (record.partition, next_offset[record.partition])
        next_offset[record.partition] += 1
        out[record.kind.split(":")[0]].add(coordinate)
    return out


def session_key_duplicates(config: dict[str, Any]) -> int:
    """Session keys written twice (0 when no session was written: on Flink with Beam 2.62 windows never fire)."""
    import psycopg
    from psycopg import sql

    pg = config["postgres"]
    with psycopg.connect(pg["dsn"], autocommit=True) as conn:
        try:
            row = conn.execute(
                sql.SQL(
                    "SELECT count(*) FROM (SELECT user_id, session_start FROM {} GROUP BY 1, 2 HAVING count(*) > 1) d"
                ).format(sql.Identifier(pg["sessions_table"]))
            ).fetchone()
        except psycopg.errors.UndefinedTable:
            return 0
        return int(row[0]) if row else 0


def check_exactly_once(config: dict[str, Any], traffic: GeneratedTraffic) -> list[str]:
    """Every produced record in exactly the sink it belongs to, once; returns the problems found (empty = clean)."""
    from pyiceberg.exceptions import NoSuchTableError

    from beamflow.iceberg.audit import audit_table
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    problems: list[str] = []
    counts = sink_counts(config)
    ice = config["iceberg"]
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"]["uri"]))
    try:
        table = catalog.load_table(ice["table"])
    except NoSuchTableError:
        return [f"the Iceberg table {ice['table']} was never created (no batch committed); sinks hold {counts}"]
    report = audit_table(table, id_column="event_id")
    held = accounted_offsets(config)
    expected = expected_coordinates(traffic)
    if report.rows != traffic.counts["events"]:
        problems.append(f"iceberg rows {report.rows} != produced events {traffic.counts['events']}")
    if counts["iceberg_distinct_ids"] != traffic.counts["events"]:
        problems.append(f"iceberg distinct ids {counts['iceberg_distinct_ids']} != {traffic.counts['events']}")
    if report.duplicate_ids:
        problems.append(f"{report.duplicate_ids} duplicate event ids in iceberg, e.g. {report.duplicate_id_sample}")
    if report.files_referenced_twice:
        problems.append(f"files referenced twice: {report.files_referenced_twice[:3]}")
    duplicate_sessions = session_key_duplicates(config)
    if duplicate_sessions:
        problems.append(f"{duplicate_sessions} duplicate session keys in PostgreSQL")
    for sink in ("iceberg", "quarantine", "dead"):
        got = held[sink]
        if len(got) != len(set(got)):
            problems.append(f"{sink}: {len(got) - len(set(got))} coordinates held twice")
    dead = set(held["dead"])
    if dead != expected["bad"]:
        problems.append(
            f"dead: missing {sorted(expected['bad'] - dead)[:5]}, unexpected {sorted(dead - expected['bad'])[:5]}"
        )
    problems.extend(_copies_kept_once(traffic, set(held["iceberg"]), set(held["quarantine"])))
    return problems


def _copies_kept_once(
    traffic: GeneratedTraffic, iceberg: set[tuple[int, int]], quarantine: set[tuple[int, int]]
) -> list[str]:
    """Per event, exactly one of its copies (the original and its duplicate sends) in Iceberg, the others quarantined.

    Which copy is kept is the first one the job processed (a stream's dedup cannot wait for a copy that may never
    come), so the check is per set of copies, not "the lowest offset": on a stream the copies of one event can reach
    the dedup on different subtasks.
    """
    problems: list[str] = []
    copies = event_copies(traffic)
    kept_none: list[list[tuple[int, int]]] = []
    kept_twice: list[list[tuple[int, int]]] = []
    unquarantined: list[tuple[int, int]] = []
    for coordinates in copies:
        kept = [c for c in coordinates if c in iceberg]
        if not kept:
            kept_none.append(coordinates)
        elif len(kept) > 1:
            kept_twice.append(coordinates)
        unquarantined.extend(c for c in coordinates if c not in iceberg and c not in quarantine)
    every = {c for coordinates in copies for c in coordinates}
    for name, got in (("iceberg", iceberg), ("quarantine", quarantine)):
        if got - every:
            problems.append(
                f"{name}: {len(got - every)} coordinates of no produced event, e.g. {sorted(got - every)[:5]}"
            )
    if kept_none:
        problems.append(f"{len(kept_none)} events with no copy in iceberg, e.g. {kept_none[:3]}")
    if kept_twice:
        problems.append(f"{len(kept_twice)} events with more than one copy in iceberg, e.g. {kept_twice[:3]}")
    if unquarantined:
        problems.append(f"{len(unquarantined)} duplicate copies neither kept nor quarantined, e.g. {unquarantined[:5]}")
    if iceberg & quarantine:
        problems.append(f"{len(iceberg & quarantine)} coordinates both in iceberg and quarantine")
    return problems


def event_copies(traffic: GeneratedTraffic) -> list[list[tuple[int, int]]]:
    """The Kafka coordinates of each event's copies: the original and its duplicate sends (same event object)."""
    next_offset: dict[int, int] = defaultdict(int)
    by_event: dict[int, list[tuple[int, int]]] = {}
    for record in traffic.records:
        coordinate = (record.partition, next_offset[record.partition])
        next_offset[record.partition] += 1
        if record.event is not None and record.kind in ("event", "duplicate"):
            by_event.setdefault(id(record.event), []).append(coordinate)
    return list(by_event.values())
