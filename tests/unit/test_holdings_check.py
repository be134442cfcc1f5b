"""The drills' "offsets never ahead of the sinks" check counts a contiguous prefix, so it fails past a gap."""

from __future__ import annotations

import pytest

from tests.flink.drill_support import OffsetSample, contiguous_prefix

pytestmark = pytest.mark.unit


def _sample(committed: dict[int, int], coordinates: list[tuple[int, int]]) -> OffsetSample:
    return OffsetSample(0.0, committed, {p: first - 1 for p, first in contiguous_prefix(coordinates).items()})


def test_a_commit_past_a_missing_offset_is_caught_even_when_later_offsets_are_held() -> None:
    # Shuffled batches: the sinks hold 0..479 and 481..500 of partition 0, not 480.
    held = [(0, o) for o in range(501) if o != 480] + [(1, o) for o in range(10)]
    broken = _sample({0: 501, 1: 10}, held)
    assert broken.ahead() == {0: (501, 480)}
    # The check before this one compared with the highest held offset (500) and let the same commit pass.
    assert max(o for p, o in held if p == 0) + 1 >= 501


def test_commits_within_the_prefix_pass() -> None:
    held = [(0, o) for o in range(480)] + [(0, 490)]
    assert _sample({0: 480}, held).ahead() == {}
    assert contiguous_prefix(held) == {0: 480}
    assert _sample({0: 1}, []).ahead() == {0: (1, 0)}


def test_a_sink_that_cannot_be_read_skips_the_sample_instead_of_reading_as_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Seen in the fault drill: a sample taken while PostgreSQL restarted read as "the sinks hold nothing" and was
    # reported as a commit ahead of the sinks. A failed read is an error of the sampler, never a holding of zero.
    from tests.flink import drill_support

    def postgres_restarting(config: object) -> dict[str, object]:
        raise OSError("connection refused")

    monkeypatch.setattr(drill_support, "committed_offsets", lambda config: {0: 377, 1: 586})
    monkeypatch.setattr(drill_support, "accounted_offsets", postgres_restarting)
    sampler = drill_support.OffsetSampler({})
    sampler.sample()
    assert sampler.samples == [] and sampler.errors == ["OSError: connection refused"]
    assert sampler.violations() == []
