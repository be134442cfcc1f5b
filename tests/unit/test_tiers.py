"""The suite's two tiers (``tests/tiers.py``): together they run every test exactly once, each on its own services."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import in_tier
from tests.tiers import ROOT, TIERS, tier_env

pytestmark = pytest.mark.unit


def _collected(data: Path, *args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"BEAMFLOW_TEST_DATA": str(data), "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_each_module_is_in_exactly_one_tier() -> None:
    table = {"unit": set(), "kafka": {"kafka", "tmp_path"}, "drill": {"flink", "kafka", "postgres"}}
    placed = {module: [tier for tier in TIERS if in_tier(tier, needs)] for module, needs in table.items()}
    assert placed == {"unit": ["other"], "kafka": ["other"], "drill": ["flink"]}
    assert all(in_tier("all", needs) for needs in table.values())


def test_the_tiers_together_collect_the_whole_suite_once(tmp_path: Path) -> None:
    whole = _collected(tmp_path, "tests")
    tiers = {tier: _collected(tmp_path, "tests", f"--tier={tier}") for tier in TIERS}
    assert sorted(tiers["other"] + tiers["flink"]) == sorted(whole)
    assert not set(tiers["other"]) & set(tiers["flink"])
    assert tiers["flink"] and all("flink" in test or "readme" in test for test in tiers["flink"]), tiers["flink"]


def test_each_tier_has_its_own_services() -> None:
    folders = {tier: tier_env(tier, {"BEAMFLOW_TEST_DATA": "/srv/ci/test"})["BEAMFLOW_TEST_DATA"] for tier in TIERS}
    assert folders == {"other": "/srv/ci/test", "flink": "/srv/ci/test-flink"}


_WAITER = """
import signal, sys, time
from pathlib import Path
stopped = Path(sys.argv[1])
def on_sigint(*_):
    stopped.write_text("SIGINT")  # pytest's KeyboardInterrupt: its session's teardown stops the services
    sys.exit(2)
signal.signal(signal.SIGINT, on_sigint)
Path(sys.argv[2]).write_text("ready")
time.sleep(60)
"""

_PARENT = """
import subprocess, sys, time
from pathlib import Path
from tests.tiers import TierRun, _stop_on_sigterm, finish
folder = Path(sys.argv[1])
runs = [
    TierRun(tier, subprocess.Popen([sys.executable, "-c", sys.argv[2], str(folder / tier), str(folder / f"{tier}.up")]),
            time.monotonic(), None)
    for tier in ("other", "flink")
]
_stop_on_sigterm(runs)
(folder / "parent.up").write_text("ready")
print([finish(run).rc for run in runs])
"""


def test_a_sigterm_stops_both_tiers_through_their_teardown(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path), _WAITER], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / name).exists() for name in ("parent.up", "other.up", "flink.up")):
        assert time.monotonic() < deadline and parent.poll() is None, "the tiers never started"
        time.sleep(0.1)
    parent.send_signal(signal.SIGTERM)
    out, _ = parent.communicate(timeout=30)
    assert parent.returncode == 0 and out.strip() == "[2, 2]", out
    assert {tier: (tmp_path / tier).read_text() for tier in ("other", "flink")} == {
        "other": "SIGINT",
        "flink": "SIGINT",
    }
