"""A small client for Flink's REST API (plain HTTP, no Beam): cluster overview, jobs, checkpoints, savepoints.

Works against any Flink 1.19+ JobManager, e.g. the session cluster ``FlinkService`` starts on 127.0.0.1::

    rest = FlinkRest("http://127.0.0.1:8081")
    for job in rest.jobs():
        print(job.job_id, job.name, job.state)
    savepoint = rest.stop_with_savepoint(job_id, "/data/flink/savepoints")
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import requests

__all__ = [
    "TERMINAL_STATES",
    "FlinkRest",
    "FlinkRestError",
    "JobSummary",
    "root_cause",
]

# Flink job states after which a job never changes again (a FAILED job in a session cluster stays FAILED).
TERMINAL_STATES = frozenset({"FINISHED", "CANCELED", "FAILED"})


def root_cause(trace: str) -> str:
    """The first line of a Java stack trace's innermost ``Caused by:`` (else of the trace itself).

    Flink reports a job that could not start as ``JobInitializationException: Could not start the JobMaster.`` and
    the reason four causes down, e.g. ``IllegalStateException: Cannot map checkpoint/savepoint state for operator
    ... to the new program``: the line a user needs is the last one.
    """
    lines = [line.strip() for line in trace.splitlines()]
    causes = [line.removeprefix("Caused by: ") for line in lines if line.startswith("Caused by: ")]
    return causes[-1] if causes else next((line for line in lines if line), "")


class FlinkRestError(RuntimeError):
    """The JobManager answered with an error, or an asynchronous operation (savepoint) failed; the message says why."""


@dataclass(frozen=True)
class JobSummary:
    """One row of ``/jobs/overview``."""

    job_id: str
    name: str
    state: str
    start_time_ms: int
    duration_ms: int


class FlinkRest:
    """Flink's REST API at ``base_url`` (``http://host:rest_port``)."""

    def __init__(self, base_url: str, timeout: float = 10.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            base_url = f"http://{base_url}"
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._session = requests.Session()

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, json_body: dict[str, Any] | None = None) -> Any:
        url = f"{self.base_url}{path}"
        response = self._session.request(method, url, json=json_body, timeout=self.timeout)
        if response.status_code >= 400:
            try:
                errors = response.json().get("errors", [response.text])
            except ValueError:
                errors = [response.text]
            # Flink puts a full Java stack trace in "errors"; the first lines carry the reason.
            reason = "; ".join(str(e).strip().splitlines()[0] for e in errors if str(e).strip()) or response.reason
            raise FlinkRestError(f"{method} {path} -> HTTP {response.status_code}: {reason}")
        if not response.content:
            return {}
        return response.json()

    # -- cluster ----------------------------------------------------------------------------------------------
    def overview(self) -> dict[str, Any]:
        """``/overview``: taskmanagers, slots-total, slots-available, jobs-running, flink-version, ..."""
        result: dict[str, Any] = self._request("GET", "/overview")
        return result

    def taskmanagers(self) -> list[dict[str, Any]]:
        return list(self._request("GET", "/taskmanagers").get("taskmanagers", []))

    def taskmanager_metrics(self, taskmanager_id: str, names: list[str]) -> dict[str, float]:
        """Current values of the TaskManager's metrics ``names`` (e.g. ``Status.JVM.Memory.Heap.Used``); a metric the
        TaskManager does not report is absent from the answer."""
        rows = self._request("GET", f"/taskmanagers/{taskmanager_id}/metrics?get={','.join(names)}")
        return {row["id"]: float(row["value"]) for row in rows or [] if row.get("value") not in (None, "")}

    def taskmanager_thread_dump(self, taskmanager_id: str) -> dict[str, str]:
        """Thread name -> its state and stack (``/taskmanagers/:id/thread-dump``; frames per thread are capped by the
        cluster's ``cluster.thread-dump.stacktrace-max-depth``)."""
        rows = self._request("GET", f"/taskmanagers/{taskmanager_id}/thread-dump").get("threadInfos", [])
        return {row["threadName"]: row["stringifiedThreadInfo"] for row in rows}

    def jobmanager_classpath(self) -> list[str]:
        """The JobManager JVM's classpath, in load order (``/jobmanager/environment``, Flink 1.17+)."""
        return list(self._request("GET", "/jobmanager/environment").get("classpath") or [])

    def config(self) -> dict[str, str]:
        """The JobManager's effective configuration as key -> value (``/jobmanager/config``)."""
        return {row["key"]: row["value"] for row in self._request("GET", "/jobmanager/config")}

    # -- jobs -------------------------------------------------------------------------------------------------
    def jobs(self) -> list[JobSummary]:
        """All jobs the cluster knows, newest first."""
        rows = self._request("GET", "/jobs/overview").get("jobs", [])
        jobs = [
            JobSummary(
                job_id=row["jid"],
                name=row.get("name", ""),
                state=row["state"],
                start_time_ms=int(row.get("start-time", 0)),
                duration_ms=int(row.get("duration", 0)),
            )
            for row in rows
        ]
        return sorted(jobs, key=lambda j: j.start_time_ms, reverse=True)

    def job(self, job_id: str) -> dict[str, Any]:
        """``/jobs/<id>``: state, vertices, timestamps."""
        result: dict[str, Any] = self._request("GET", f"/jobs/{job_id}")
        return result

    def job_state(self, job_id: str) -> str:
        return str(self.job(job_id)["state"])

    def partitions_read_by_subtask(self, job_id: str, topic: str) -> dict[int, set[int]]:
        """Which Kafka partitions of ``topic`` each subtask of a running job's read has read, by subtask index.

        From the read's per-partition Beam counters (``records_read.<topic>-<partition>``, which Flink registers per
        subtask once the subtask reads that partition): who reads what is the runner's key hash, not a setting.
        Flink serves metrics from a store its JobManager refreshes asynchronously after a request (at most every
        ``metrics.fetcher.update-interval``, 10 s), so a first answer may miss counters: ask again until complete.
        """
        marker = f"records_read_{topic}-"
        owners: dict[int, set[int]] = {}
        for vertex in self.job(job_id).get("vertices", []):
            if "ReadPartitions" not in vertex.get("name", ""):
                continue
            for subtask in range(int(vertex.get("parallelism", 1))):
                metrics = self._request("GET", f"/jobs/{job_id}/vertices/{vertex['id']}/subtasks/{subtask}/metrics")
                for metric in metrics:
                    name = str(metric["id"])
                    if marker in name and name.rsplit("-", 1)[-1].isdigit():
                        owners.setdefault(subtask, set()).add(int(name.rsplit("-", 1)[-1]))
        return owners

    def job_exceptions(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", f"/jobs/{job_id}/exceptions")
        return result

    def failure_history(self, job_id: str) -> list[dict[str, Any]]:
        """The job's failures so far, oldest first (each one a failover or restart): ``[]`` for a job that never
        failed. Per-attempt figures (Beam's counters among them) start over after each."""
        entries: list[dict[str, Any]] = self.job_exceptions(job_id).get("exceptionHistory", {}).get("entries", [])
        return entries

    def failure_cause(self, job_id: str) -> str:
        """Why the job failed, in one line: the innermost cause of Flink's root exception ("" if it has none)."""
        return root_cause(str(self.job_exceptions(job_id).get("root-exception") or ""))

    def wait_for_state(self, job_id: str, states: set[str] | frozenset[str], timeout: float = 120.0) -> str:
        """Polls until the job is in one of ``states``; raises FlinkRestError if it ends in another terminal one."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            if state in TERMINAL_STATES:
                raise FlinkRestError(f"job {job_id} ended {state}, expected one of {sorted(states)}")
            time.sleep(0.5)
        raise FlinkRestError(f"job {job_id} still {state} after {timeout:.0f}s, expected one of {sorted(states)}")

    def cancel(self, job_id: str) -> None:
        self._request("PATCH", f"/jobs/{job_id}?mode=cancel")

    # -- checkpoints and savepoints ---------------------------------------------------------------------------
    def checkpoints(self, job_id: str) -> dict[str, Any]:
        """``/jobs/<id>/checkpoints``: counts (completed, failed, in_progress), latest, history."""
        result: dict[str, Any] = self._request("GET", f"/jobs/{job_id}/checkpoints")
        return result

    def completed_checkpoints(self, job_id: str) -> int:
        return int(self.checkpoints(job_id).get("counts", {}).get("completed", 0))

    def latest_checkpoint_path(self, job_id: str) -> str | None:
        """Where the newest completed checkpoint lives (restorable if checkpoints are retained), or None."""
        latest = (self.checkpoints(job_id).get("latest") or {}).get("completed") or {}
        path = latest.get("external_path")
        return str(path) if path else None

    def wait_for_checkpoints(self, job_id: str, count: int = 1, timeout: float = 120.0) -> int:
        """Waits until at least ``count`` checkpoints completed; returns the number completed."""
        deadline = time.monotonic() + timeout
        done = 0
        while time.monotonic() < deadline:
            done = self.completed_checkpoints(job_id)
            if done >= count:
                return done
            state = self.job_state(job_id)
            if state in TERMINAL_STATES:
                raise FlinkRestError(f"job {job_id} ended {state} after {done} checkpoint(s), wanted {count}")
            time.sleep(0.5)
        raise FlinkRestError(f"job {job_id}: {done} checkpoint(s) completed after {timeout:.0f}s, wanted {count}")

    def trigger_savepoint(self, job_id: str, target_dir: str | None = None, cancel_job: bool = False) -> str:
        """Starts a savepoint; returns its trigger id (see ``wait_for_savepoint``)."""
        body: dict[str, Any] = {"cancel-job": cancel_job}
        if target_dir:
            body["target-directory"] = target_dir
        return str(self._request("POST", f"/jobs/{job_id}/savepoints", body)["request-id"])

    def stop(self, job_id: str, target_dir: str | None = None, drain: bool = False) -> str:
        """Stop-with-savepoint (``drain`` advances the watermark to the end first); returns the trigger id."""
        body: dict[str, Any] = {"drain": drain}
        if target_dir:
            body["targetDirectory"] = target_dir
        return str(self._request("POST", f"/jobs/{job_id}/stop", body)["request-id"])

    def wait_for_savepoint(self, job_id: str, trigger_id: str, timeout: float = 120.0) -> str:
        """Waits for a savepoint trigger to finish; returns the savepoint's path or raises with Flink's reason."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self._request("GET", f"/jobs/{job_id}/savepoints/{trigger_id}")
            if result.get("status", {}).get("id") == "COMPLETED":
                operation = result.get("operation", {})
                if "location" in operation:
                    return str(operation["location"])
                cause = operation.get("failure-cause", {})
                stack = str(cause.get("stack-trace", "")).strip().splitlines()
                raise FlinkRestError(
                    f"savepoint of job {job_id} failed: {cause.get('class', '')}: {stack[0] if stack else cause}"
                )
            time.sleep(0.5)
        raise FlinkRestError(f"savepoint {trigger_id} of job {job_id} not done after {timeout:.0f}s")

    def stop_with_savepoint(
        self, job_id: str, target_dir: str | None = None, drain: bool = False, timeout: float = 120.0
    ) -> str:
        """Stops the job with a savepoint and returns the savepoint path (restore it with ``--savepoint_path``)."""
        return self.wait_for_savepoint(job_id, self.stop(job_id, target_dir, drain), timeout)
