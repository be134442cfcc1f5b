"""The suite's two tiers (``tests/tiers.py``): together they run every test exactly once, each on its own services."""

from __future__ import annotations

import subprocess
import sys
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
