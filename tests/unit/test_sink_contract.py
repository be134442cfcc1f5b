"""The sink contract: every sink on ``transforms.sink_base``, one result type, guarantees declared and in the README."""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.window import TimestampedValue

import transforms
from beamflow.deadletter import DeadLetter
from runners.direct import local_options
from transforms.sink_base import DEAD_LETTERS, Declared, Guarantee, SinkFn, SinkResult, write_with
from transforms.write_dead_letters import WriteDeadLetters
from transforms.write_sessions import WriteSessions
from transforms.write_to_iceberg import WriteToIceberg
from transforms.write_to_postgres import WriteToPostgres
from transforms.write_versioned_cells import WriteVersionedCells

README = Path(__file__).resolve().parents[2] / "README.md"


def _sink_transforms() -> list[type[beam.PTransform]]:
    """Every PTransform under transforms/ that declares its guarantees (``GUARANTEES``): the sinks."""
    found: dict[str, type[beam.PTransform]] = {}
    for info in pkgutil.walk_packages(transforms.__path__, "transforms."):
        for value in vars(importlib.import_module(info.name)).values():
            if isinstance(value, type) and issubclass(value, beam.PTransform) and "GUARANTEES" in vars(value):
                found[value.__name__] = value
    return sorted(found.values(), key=lambda t: t.__name__)


SINK_TRANSFORMS = _sink_transforms()
# A bold guarantee in the README's table, optionally followed by the variant it applies to: **idempotent** (`postgres`)
_BOLD = re.compile(r"\*\*([a-z-]+)\*\*(?: \(`(\w+)`\))?")


def _readme_row(name: str) -> str:
    """The guarantee cell of the README table row that names ``name``."""
    for line in README.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and re.search(rf"`(transforms\.)?{name}`", cells[0]):
            return cells[1]
    raise AssertionError(f"README's guarantee table has no row for {name}")


def _guarantees(sink: type[beam.PTransform]) -> dict[str, Declared]:
    declared: dict[str, Declared] = sink.GUARANTEES  # type: ignore[attr-defined]
    return declared


def declared_in_readme(name: str) -> set[tuple[str, str]]:
    return {(guarantee, variant or "") for guarantee, variant in _BOLD.findall(_readme_row(name))}


@pytest.mark.parametrize("sink", SINK_TRANSFORMS, ids=lambda t: t.__name__)
def test_readme_guarantee_table_matches_the_declarations(sink: type[beam.PTransform]) -> None:
    declared = {(d.guarantee.value, variant) for variant, d in _guarantees(sink).items()}
    assert declared_in_readme(sink.__name__) == declared


def test_the_known_sinks_are_found() -> None:
    expected = {WriteToPostgres, WriteVersionedCells, WriteSessions, WriteToIceberg, WriteDeadLetters}
    assert expected <= set(SINK_TRANSFORMS)


def test_the_readme_check_sees_a_wrong_guarantee() -> None:
    # What the check reads: a row promising more than the sink declares differs from the declaration.
    assert declared_in_readme("WriteDeadLetters") == {("idempotent", "postgres"), ("at-least-once", "kafka")}
    assert ("exactly-once", "") not in declared_in_readme("WriteToPostgres")


def _all_sink_fns(cls: type[SinkFn] = SinkFn) -> Iterable[type[SinkFn]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_sink_fns(sub)


def test_every_sink_fn_declares_a_guarantee_and_every_sink_transform_lists_its_own() -> None:
    fns = [fn for fn in _all_sink_fns() if fn.__module__.startswith("transforms.")]
    assert {fn.__name__ for fn in fns} >= {
        "_UpsertFn",
        "_MutateFn",
        "_CommitPerBundle",
        "_ProduceFn",
        "_MergeSessionsFn",
    }
    for fn in fns:
        assert isinstance(fn.GUARANTEE, Declared) and isinstance(fn.GUARANTEE.guarantee, Guarantee), fn
        assert fn.GUARANTEE.needs, fn
    listed = {id(d) for sink in SINK_TRANSFORMS for d in _guarantees(sink).values()}
    assert all(id(fn.GUARANTEE) in listed for fn in fns)


class _EveryThirdFn(SinkFn):
    """Refuses odd elements at add, flushes every third element early and the rest at the bundle's end."""

    GUARANTEE = Declared(Guarantee.AT_LEAST_ONCE, "nothing (a test sink)")

    def open(self) -> None:
        self.buffer: list[int] = []

    def add(self, n: int) -> list[Any]:
        if n % 2:
            return [self.dead_letter(n, "odd")]
        self.buffer.append(n)
        return self.flush() if len(self.buffer) >= 3 else []

    def flush(self) -> list[Any]:
        batch, self.buffer = self.buffer, []
        refused = [self.dead_letter(n, "ten") for n in batch if n == 10]
        return [*refused, {"rows_written": len(batch) - len(refused)}] if batch else []


def test_sink_fn_routes_dead_letters_and_reports_in_the_global_window() -> None:
    with beam.Pipeline(options=local_options()) as p:
        stamped = p | beam.Create(range(12)) | beam.Map(lambda n: TimestampedValue(n, 100 + n))
        result = write_with(stamped, _EveryThirdFn())
        assert isinstance(result, SinkResult)
        reasons = result.dead_letters | beam.Map(lambda d: (d.stage, d.reason, int(d.payload)))
        expected = [("_EveryThirdFn", "odd", n) for n in range(1, 12, 2)] + [("_EveryThirdFn", "ten", 10)]
        assert_that(reasons, equal_to(expected), label="dead letters")
        total = result.written | beam.Map(lambda r: r["rows_written"]) | beam.CombineGlobally(sum)
        assert_that(total, equal_to([5]), label="written")
        windows = (result.written, result.dead_letters) | beam.Flatten() | beam.ParDo(_WindowOf())
        assert_that(windows | beam.Distinct(), equal_to(["GlobalWindow"]), label="global window")


class _WindowOf(beam.DoFn):
    def process(self, _: Any, window: Any = beam.DoFn.WindowParam) -> Iterable[Any]:
        yield type(window).__name__


def test_dead_letters_have_one_name() -> None:
    assert DEAD_LETTERS == "dead_letters"
    assert DeadLetter.__name__ == "DeadLetter"
