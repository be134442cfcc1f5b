"""Issue 3's idle-partition acceptance on Flink: real streaming watermarks, one partition that never gets data.

One job, two reads of the same 3-partition topic (different groups): one with ``idle_timeout_ms`` set, one with None.
Partition 2 never receives a record. Fixed 1-minute windows over the other partitions must fire while the job still
runs with the idle timeout, and must not fire without it. Each window's count is written to a file by the SDK worker,
so the test sees what the cluster really emitted, while the job runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from beamflow.cli import main as cli_main
from beamflow.cli.status import collect_status, format_status
from beamflow.flink_rest import FlinkRest
from beamflow.kafka.admin import create_topic, produce
from beamflow.services import ServiceState
from beamflow.services.paths import project_root

pytestmark = pytest.mark.flink

WINDOW_S = 60
JOB = """
import os, sys
import apache_beam as beam
from apache_beam.transforms.window import FixedWindows
from runners.flink import options_for_service
from beamflow.services import ServiceState
from transforms.read_from_kafka import ReadFromKafka

bootstrap, topic, out_dir, job_name, state_path, window_s = sys.argv[1:7]


class WriteWindow(beam.DoFn):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def process(self, count, window=beam.DoFn.WindowParam):
        name = f"{int(window.start.micros // 1_000_000)}.txt"
        with open(os.path.join(self.out_dir, name), "w") as f:
            f.write(str(count))
        yield count


state = ServiceState.load(__import__("pathlib").Path(state_path))
options = options_for_service(state, {"job_name": job_name, "parallelism": 1, "checkpointing_interval_ms": 3000})
p = beam.Pipeline(options=options)
for label, idle in (("idle", 3000), ("no_idle", None)):
    os.makedirs(os.path.join(out_dir, label), exist_ok=True)
    (
        p
        | f"Read_{label}" >> ReadFromKafka(bootstrap, [topic], group_id=f"{job_name}-{label}", idle_timeout_ms=idle)
        | f"Window_{label}" >> beam.WindowInto(FixedWindows(int(window_s)))
        | f"One_{label}" >> beam.Map(lambda r: 1)
        | f"Count_{label}" >> beam.CombineGlobally(sum).without_defaults()
        | f"Write_{label}" >> beam.ParDo(WriteWindow(os.path.join(out_dir, label)))
    )
p.run().wait_until_finish()
"""


@pytest.fixture(scope="module")
def windows_job(
    kafka: ServiceState, flink: ServiceState, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, FlinkRest, str]]:
    tmp_path = tmp_path_factory.mktemp("idle-windows")
    topic = f"idle-{uuid.uuid4().hex[:8]}"
    create_topic(kafka.info["bootstrap"], topic, 3)
    # Two complete minutes of event time, well in the past: only the watermark decides when their windows fire.
    now_s = int(time.time())
    first_window = (now_s // WINDOW_S - 4) * WINDOW_S
    records = [
        (b"k", f"{i}".encode(), {"partition": i % 2, "timestamp_ms": (first_window + i) * 1000})
        for i in range(2 * WINDOW_S)
    ]
    assert produce(kafka.info["bootstrap"], topic, records) == len(records)
    job_name = f"idle-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    state_path = Path(flink.info["conf_dir"]).parent / "state.json"
    log = open(tmp_path / "job.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, str(script), kafka.info["bootstrap"], topic, str(tmp_path), job_name, str(state_path),
         str(WINDOW_S)],
        cwd=project_root(), stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(project_root())}, start_new_session=True,
    )  # fmt: skip
    rest = FlinkRest(flink.info["rest_url"])
    job_id = ""
    try:
        deadline = time.monotonic() + 240
        while not job_id:
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            job_id = next((j.job_id for j in rest.jobs() if j.name == job_name and j.state == "RUNNING"), "")
            time.sleep(1)
        yield tmp_path, rest, job_id
    finally:
        if job_id:
            rest.cancel(job_id)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def _windows(folder: Path) -> dict[str, str]:
    return {p.stem: p.read_text() for p in folder.iterdir()} if folder.exists() else {}


def test_windows_fire_while_running_only_with_idle_timeout(windows_job: tuple[Path, FlinkRest, str]) -> None:
    out, rest, job_id = windows_job
    rest.wait_for_checkpoints(job_id, 1, timeout=180)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and len(_windows(out / "idle")) < 2:
        time.sleep(2)
    fired = _windows(out / "idle")
    assert rest.job_state(job_id) == "RUNNING"  # results appeared while the job still runs
    assert sorted(int(v) for v in fired.values()) == [WINDOW_S, WINDOW_S], fired
    # The same data without idleness: partition 2 pins the watermark, so nothing fired in the same time.
    assert _windows(out / "no_idle") == {}


def test_status_shows_beam_metrics_and_checkpoints_of_the_running_job(
    windows_job: tuple[Path, FlinkRest, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, rest, job_id = windows_job
    rest.wait_for_checkpoints(job_id, 1, timeout=180)
    deadline = time.monotonic() + 120  # Beam metrics reach Flink when the first bundles finish
    status = collect_status(rest, job_id)
    while status.metrics.get("beamflow_kafka_records_read", 0) < 2 * WINDOW_S and time.monotonic() < deadline:
        time.sleep(3)
        status = collect_status(rest, job_id)
    assert status.state == "RUNNING"
    assert status.metrics["beamflow_kafka_records_read"] == 2 * 2 * WINDOW_S  # two reads of the same 120 records
    assert status.checkpoints["completed"] >= 1 and status.checkpoints["failed"] >= 0
    assert status.min_output_watermark_ms is None  # the -inf watermark of the xfail above, as status reports it
    table = format_status(status)
    assert "records read from Kafka" in table and "240" in table and "not advanced (-inf)" in table
    assert cli_main(["status", "--rest", rest.base_url, "--job", job_id]) == 0
    printed = capsys.readouterr().out
    assert "records read from Kafka" in printed and "checkpoints completed / failed / in progress" in printed
