"""What the parent samples while a variant runs: the group's consumer lag, and the Flink JVMs' CPU, RSS and heap."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from beamflow.process_memory import proc_rss_mb


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
            rss = proc_rss_mb(self.roles.get("taskmanager", -1))
            self.peak_rss_mb = max(self.peak_rss_mb, rss or 0.0)
            try:
                tm_id = tm_id or rest.taskmanagers()[0]["id"]
                heap = rest.taskmanager_metrics(tm_id, ["Status.JVM.Memory.Heap.Used"])["Status.JVM.Memory.Heap.Used"]
                self.peak_heap_mb = max(self.peak_heap_mb, heap / 2**20)
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
