"""The pinned local runner profile (runners/direct.py): FnApiRunner, one worker, and its process-wide settings, which
apply only while a pipeline runs and are restored when it ends."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from apache_beam.runners.worker import statesampler
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.utils.counters import CounterFactory

from runners.direct import GC_THRESHOLDS, LOCAL_RUNNER, SAMPLING_PERIOD_MS, local_options, local_settings

pytestmark = pytest.mark.unit

# What the in-process worker saw while the pipeline ran (FnApiRunner runs DoFns in this process).
_SEEN: list[dict[str, Any]] = []


def _settings() -> dict[str, Any]:
    return {
        "sampling_period_ms": statesampler.StateSampler("fnapi-step-test", CounterFactory()).sampling_period_ms,
        "state_cache_mb": worker_handlers.STATE_CACHE_SIZE_MB,
        "gc_threshold": gc.get_threshold(),
        "gc_frozen": gc.get_freeze_count(),
    }


class _Record(beam.DoFn):
    def process(self, element: int) -> Iterator[int]:
        _SEEN.append(_settings())
        yield element * 2


@pytest.fixture
def python_defaults() -> Iterator[dict[str, Any]]:
    """CPython's own gc settings (some earlier test may have changed them), put back afterwards."""
    thresholds = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    yield _settings()
    gc.set_threshold(*thresholds)


def test_local_options_pin_fnapirunner_with_one_worker_whatever_runner_was_asked() -> None:
    options = local_options(["--runner=DirectRunner", "--direct_num_workers=4"]).get_all_options()
    assert options["runner"] == LOCAL_RUNNER
    assert options["direct_num_workers"] == 1  # more workers drop SDF residuals
    assert options["streaming"] is False


def test_settings_apply_while_the_pipeline_runs_and_are_restored_after(python_defaults: dict[str, Any]) -> None:
    assert python_defaults["sampling_period_ms"] == statesampler.DEFAULT_SAMPLING_PERIOD_MS
    assert python_defaults["gc_frozen"] == 0
    options = local_options()
    assert _settings() == python_defaults  # building options changes nothing
    _SEEN.clear()
    with beam.Pipeline(options=options) as p:
        assert_that(p | beam.Create([1, 2, 3]) | beam.ParDo(_Record()), equal_to([2, 4, 6]))
    assert len(_SEEN) == 3
    during = _SEEN[0]
    # Inside the run: bundle samplers wake every SAMPLING_PERIOD_MS (what BundleProcessor builds per bundle takes the
    # constructor's default), no state cache, what the imports left frozen, the young generation collected less often.
    assert during["sampling_period_ms"] == SAMPLING_PERIOD_MS < statesampler.DEFAULT_SAMPLING_PERIOD_MS
    assert during["state_cache_mb"] == 0
    assert during["gc_threshold"] == GC_THRESHOLDS
    assert during["gc_frozen"] > 10_000  # Beam alone leaves far more than that
    assert _settings() == python_defaults  # and all of it undone when the run ended


def test_settings_are_restored_when_the_run_fails(python_defaults: dict[str, Any]) -> None:
    def fail(x: int) -> int:
        raise RuntimeError("boom")

    with pytest.raises(Exception, match="boom"), beam.Pipeline(options=local_options()) as p:
        _ = p | beam.Create([1]) | beam.Map(fail)
    assert _settings() == python_defaults


def test_local_settings_keep_a_callers_own_frozen_objects_frozen(python_defaults: dict[str, Any]) -> None:
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        with local_settings():
            assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() >= frozen and gc.get_threshold() == (700, 10, 10)
    finally:
        gc.unfreeze()
