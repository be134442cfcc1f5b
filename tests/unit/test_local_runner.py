"""The pinned local runner profile (runners/direct.py): FnApiRunner, one worker, and its two process-wide settings."""

from __future__ import annotations

import gc

import apache_beam as beam
import pytest
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from apache_beam.runners.worker import statesampler
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.utils.counters import CounterFactory

from runners.direct import GC_THRESHOLDS, LOCAL_RUNNER, SAMPLING_PERIOD_MS, local_options

pytestmark = pytest.mark.unit


def test_local_options_pin_fnapirunner_with_one_worker_whatever_runner_was_asked() -> None:
    options = local_options(["--runner=DirectRunner", "--direct_num_workers=4"]).get_all_options()
    assert options["runner"] == LOCAL_RUNNER
    assert options["direct_num_workers"] == 1  # more workers drop SDF residuals
    assert options["streaming"] is False


def test_bundle_samplers_wake_every_sampling_period_and_state_cache_is_off() -> None:
    local_options()
    # What BundleProcessor builds for each bundle: no period argument, so the constructor's default applies.
    sampler = statesampler.StateSampler("fnapi-step-test", CounterFactory())
    assert sampler.sampling_period_ms == SAMPLING_PERIOD_MS < statesampler.DEFAULT_SAMPLING_PERIOD_MS
    assert worker_handlers.STATE_CACHE_SIZE_MB == 0
    with beam.Pipeline(options=local_options()) as p:
        assert_that(p | beam.Create([1, 2, 3]) | beam.Map(lambda x: x * 2), equal_to([2, 4, 6]))


def test_local_options_freeze_what_the_imports_left_and_collect_less_often() -> None:
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    assert gc.get_freeze_count() == 0
    local_options()
    assert gc.get_freeze_count() > 10_000  # Beam alone leaves far more than that
    assert gc.get_threshold() == GC_THRESHOLDS
