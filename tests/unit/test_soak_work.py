"""The soak's check on the Python workers' CPU a minute (``benchmarks.soak.work_growth``): flat work meets the goal,
work that grows with the run (the 80-minute soak that found the committer rescanning late minutes: 9.5 -> 20.3 CPU
seconds a minute per worker) misses it, a step (the known keys filling their bound) is not growth, and an interval
in which the workers restarted is left out."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.soak import GOAL_GROWTH, work_growth

pytestmark = pytest.mark.unit


def _samples(per_minute: list[float], restart_at: int | None = None) -> list[dict[str, Any]]:
    samples, cpu, pids = [], 0.0, [101, 102]
    for minute, rate in enumerate([0.0, *per_minute]):
        if minute == restart_at:
            cpu, pids = 0.0, [201, 202]  # fresh workers count from zero
        cpu += rate
        samples.append({"t_s": 60 * minute, "python_workers_cpu_s": cpu, "python_workers_pids": pids})
    return samples


def test_flat_work_meets_the_goal_and_doubling_work_misses_it() -> None:
    flat = work_growth(_samples([19.0, 20.0, 21.0] * 10), from_s=0)
    assert flat is not None and abs(flat[2]) < GOAL_GROWTH
    # A step up once the known keys fill their bound, then flat: met (the second half is compared).
    step = work_growth(_samples([7.5] * 12 + [10.5] * 28), from_s=0)
    assert step is not None and step[2] == 0.0
    # The soak before the fix: a slope all the way.
    growing = work_growth(_samples([9.5 + 0.15 * m for m in range(80)]), from_s=0)
    assert growing is not None and growing[2] > GOAL_GROWTH
    assert (round(growing[0], 1), round(growing[1], 1)) == (15.8, 21.1)


def test_a_restart_interval_is_left_out_and_too_few_samples_say_so() -> None:
    result = work_growth(_samples([20.0] * 30, restart_at=20), from_s=0)
    assert result is not None and result[:2] == (20.0, 20.0)
    assert work_growth(_samples([20.0] * 12), from_s=0) is None  # the second half has 6 intervals, 10 are needed
    assert work_growth(_samples([20.0] * 30), from_s=25 * 60) is None  # only the intervals from minute 25 count
