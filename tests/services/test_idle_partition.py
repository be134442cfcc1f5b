"""Seed 002, question 3: one silent partition must not stop windows from firing (on a real streaming runner)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.transforms.window import FixedWindows

from beamflow.kafka.admin import create_topic, produce
from beamflow.services import ServiceState
from runners.prism import prism_options
from transforms.read_from_kafka import ReadFromKafka, StopPolicy

pytestmark = [pytest.mark.services, pytest.mark.usefixtures("prism")]


class _RecordFiring(beam.DoFn):
    """Writes each fired window's wall-clock firing time to a file (the runner may live in another thread)."""

    def __init__(self, out: str) -> None:
        self._out = out

    def process(self, kv: tuple[str, int], window: object = beam.DoFn.WindowParam) -> None:
        with open(self._out, "a") as f:
            f.write(f"{time.time() * 1000:.0f} {kv[1]}\n")


def _fire_times(kafka: ServiceState, out: Path) -> tuple[int, dict[str, list[tuple[int, int]]]]:
    """One pipeline, two reads of the same topic: with a 3 s idle timeout ("on") and without ("off"). One run for
    both keeps the test at one 45 s stream instead of two."""
    # Options first: the first call builds Prism (minutes on a cold cache), which must not eat the read's time budget.
    options = prism_options()
    bootstrap = kafka.info["bootstrap"]
    topic = f"idle-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 4)
    now = int(time.time() * 1000)
    # Partitions 0-2 hold ten minutes of data ending five minutes ago; partition 3 never receives a record.
    produce(
        bootstrap,
        topic,
        ((None, b"x", {"partition": i % 3, "timestamp_ms": now - 900_000 + i * 200}) for i in range(3000)),
    )
    until = now + 45_000
    variants = {"on": 3_000, "off": None}
    with beam.Pipeline(options=options) as p:
        for label, idle_timeout_ms in variants.items():
            (
                p
                | f"Read-{label}"
                >> ReadFromKafka(
                    bootstrap,
                    [topic],
                    f"g-{label}-{uuid.uuid4().hex[:6]}",
                    stop=StopPolicy(until_ms=until),
                    idle_timeout_ms=idle_timeout_ms,
                    commit_offsets=False,  # Prism 2.62 does not support bundle finalization
                )
                | f"Minutes-{label}" >> beam.WindowInto(FixedWindows(60))
                | f"One-{label}" >> beam.Map(lambda r: ("k", 1))
                | f"Count-{label}" >> beam.CombinePerKey(sum)  # type: ignore[arg-type]
                | f"Fired-{label}" >> beam.ParDo(_RecordFiring(str(out / f"{label}.txt")))
            )
    fired: dict[str, list[tuple[int, int]]] = {}
    for label in variants:
        path = out / f"{label}.txt"
        lines = path.read_text().split() if path.exists() else []
        fired[label] = [(int(lines[i]), int(lines[i + 1])) for i in range(0, len(lines), 2)]
    return until, fired


def test_windows_fire_mid_stream_with_idleness_and_not_without(kafka: ServiceState, tmp_path: Path) -> None:
    until, fired = _fire_times(kafka, tmp_path)
    on, off = fired["on"], fired["off"]
    assert sum(n for _, n in on) == 3000  # every record counted in some window
    assert on and max(t for t, _ in on) < until, "with idleness the windows fire while the read still runs"
    assert sum(n for _, n in off) == 3000
    assert min(t for t, _ in off) >= until, "without idleness the silent partition holds every window back"
