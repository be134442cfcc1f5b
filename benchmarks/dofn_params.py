"""What a DoFn's per-element parameters cost on the pinned local runner, against a DoFn that takes none, same run.

    .venv/bin/python -m benchmarks.dofn_params [--elements 400000] [--repeat 3]

Beam 2.62 calls a DoFn whose ``process`` takes only the element through its ``SimpleInvoker``; any other parameter
(``TimestampParam``, ``WindowParam``, ``WindowedValueParam``, a side input, an extra argument) switches it to the
``PerWindowInvoker``, which resolves every parameter per element through a chain of Python ``__eq__`` comparisons
(``apache_beam/runners/common.py``, ``_invoke_process_per_window``), and ``TimestampParam`` builds a ``Timestamp``
each time. This prints each variant's microseconds per element over the generator alone and its ratio to the plain
DoFn; the variants that emit show what re-wrapping an element in a new ``WindowedValue`` costs against emitting the
windowed value it came in. Why beamflow's DoFns take ``WindowedValueParam`` and read ``timestamp_micros``
(``transforms/sink_base.py``, the dedup's first-copy claim, the partial sessions). Each DoFn counts what it saw
(a Beam counter); the run fails unless every variant saw every element.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.utils.windowed_value import WindowedValue

from runners.direct import local_options

_SEEN = Metrics.counter("bench.dofn_params", "seen")


class _Generate(beam.DoFn):
    def __init__(self, n: int) -> None:
        self._n = n

    def process(self, _: Any) -> Iterator[int]:
        yield from range(self._n)


class _Plain(beam.DoFn):
    def process(self, element: int) -> None:
        _SEEN.inc()


class _Windowed(beam.DoFn):
    def process(self, element: int, windowed: Any = beam.DoFn.WindowedValueParam) -> None:
        _SEEN.inc()
        self.micros = windowed.timestamp_micros


class _Timestamp(beam.DoFn):
    def process(self, element: int, timestamp: Any = beam.DoFn.TimestampParam) -> None:
        _SEEN.inc()
        self.micros = timestamp.micros


class _TimestampAndWindow(beam.DoFn):
    def process(
        self, element: int, timestamp: Any = beam.DoFn.TimestampParam, window: Any = beam.DoFn.WindowParam
    ) -> None:
        _SEEN.inc()
        self.micros = timestamp.micros


class _EmitPlain(beam.DoFn):
    def process(self, element: int) -> Iterator[int]:
        _SEEN.inc()
        yield element


class _EmitSameWindowedValue(beam.DoFn):
    def process(self, element: int, windowed: Any = beam.DoFn.WindowedValueParam) -> Iterator[Any]:
        _SEEN.inc()
        yield windowed


class _EmitRewrapped(beam.DoFn):
    def process(
        self, element: int, timestamp: Any = beam.DoFn.TimestampParam, window: Any = beam.DoFn.WindowParam
    ) -> Iterator[Any]:
        _SEEN.inc()
        yield WindowedValue(element, timestamp, (window,))


VARIANTS: dict[str, type[beam.DoFn] | None] = {
    "generator alone": None,
    "no parameter": _Plain,
    "WindowedValueParam": _Windowed,
    "TimestampParam": _Timestamp,
    "TimestampParam + WindowParam": _TimestampAndWindow,
    "emits the element": _EmitPlain,
    "emits its windowed value": _EmitSameWindowedValue,
    "emits a new WindowedValue": _EmitRewrapped,
}


def run(fn: type[beam.DoFn] | None, n: int) -> tuple[float, int]:
    """Seconds of the pipeline, and how many elements the DoFn under test counted."""
    start = time.perf_counter()
    p = beam.Pipeline(options=local_options())
    elements = p | beam.Impulse() | beam.ParDo(_Generate(n))
    if fn is not None:
        elements | beam.ParDo(fn())
    result = p.run()
    result.wait_until_finish()
    seconds = time.perf_counter() - start
    counters = result.metrics().query(MetricsFilter().with_name("seen"))["counters"]
    return seconds, sum(c.committed for c in counters)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=400_000)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the best of each counts")
    args = parser.parse_args(argv)
    best: dict[str, float] = {}
    problems = []
    for _ in range(args.repeat):
        for name, fn in VARIANTS.items():
            seconds, seen = run(fn, args.elements)
            best[name] = min(best.get(name, seconds), seconds)
            if fn is not None and seen != args.elements:
                problems.append(f"{name}: saw {seen:,} of {args.elements:,}")
    floor = best["generator alone"]
    plain = (best["no parameter"] - floor) / args.elements
    print(f"{args.elements:,} elements, best of {args.repeat}; us per element over the generator alone")
    print(f"{'variant':30} {'us/element':>10} {'x no parameter':>15}")
    for name in list(VARIANTS)[1:]:
        per = (best[name] - floor) / args.elements
        print(f"{name:30} {per * 1e6:10.2f} {per / plain:15.1f}")
    if problems:
        raise SystemExit("AUDIT FAILED: " + "; ".join(problems))
    print("audit: every variant's DoFn counted every element")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
