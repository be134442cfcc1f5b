"""The sink contract every beamflow sink is written against: ``SinkFn``, ``Declared``/``Guarantee``, ``SinkResult``.

A sink is one DoFn with four steps, each called by Beam at the right time:

- ``open()`` (Beam's ``setup``): open the pool, client or producer once per DoFn instance, never per element;
- ``add(element)`` (``process``): buffer the element; return the outputs of a batch flushed early (at a size or age
  threshold), else nothing;
- ``flush()`` (``finish_bundle``): write everything buffered, durably, before the bundle ends (so before a
  checkpoint, and before the Kafka offsets of the bundle are committed); return the outputs;
- ``close()`` (``teardown``): release what ``open`` opened.

Outputs are sorted by type: a ``DeadLetter`` goes to the output named ``dead_letters`` (the one name every beamflow
stage uses), anything else (a report of a written batch: a dict with at least ``rows_written``) to the main output,
``written``. Outputs of ``flush`` are placed in the global window at the newest buffered element's timestamp (Beam
needs an explicit window there). A sink that cannot write an element for the element's own sake returns a dead
letter with the reason; one that cannot write at all raises, so the runner retries the bundle.

Each ``SinkFn`` declares its delivery guarantee as data (``GUARANTEE``, a ``Declared``); each sink transform lists
its declarations in ``GUARANTEES`` (the README's guarantee table is tested against them) and returns a
``SinkResult(written, dead_letters)`` that can be passed whole to ``CommitOffsetsAfter(after=[...])``.

A complete sink, appending lines to a file (at-least-once: a retried bundle appends its lines again)::

    import tempfile
    import apache_beam as beam
    from runners.direct import local_options
    from transforms.sink_base import Declared, Guarantee, SinkFn, write_with

    class _AppendLinesFn(SinkFn):
        GUARANTEE = Declared(Guarantee.AT_LEAST_ONCE, "a replayed bundle appends its lines again")

        def __init__(self, path):
            super().__init__()
            self.path = path

        def open(self):
            self.lines = []

        def add(self, line):
            if not isinstance(line, str):
                return [self.dead_letter(line, f"expected a str, got {type(line).__name__}")]
            self.lines.append(line)
            return ()

        def flush(self):
            lines, self.lines = self.lines, []
            with open(self.path, "a") as out:
                out.writelines(f"{line}\\n" for line in lines)
            return [{"rows_written": len(lines)}] if lines else []

    class AppendLines(beam.PTransform):
        GUARANTEES = {"": _AppendLinesFn.GUARANTEE}

        def __init__(self, path):
            super().__init__()
            self.path = path

        def expand(self, lines):
            return write_with(lines, _AppendLinesFn(self.path))

    with beam.Pipeline(options=local_options()) as p:
        result = p | beam.Create(["a", "b", 3]) | AppendLines(tempfile.mkdtemp() + "/lines.txt")
        result.dead_letters | beam.Map(lambda d: print(d.reason))   # expected a str, got int
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import apache_beam as beam
from apache_beam.pvalue import TaggedOutput
from apache_beam.utils.timestamp import MIN_TIMESTAMP, Timestamp

from beamflow.deadletter import DeadLetter, encode_payload
from transforms._global_window import in_global_window

__all__ = ["DEAD_LETTERS", "WRITTEN", "Declared", "Guarantee", "SinkFn", "SinkResult", "write_with"]

DEAD_LETTERS = "dead_letters"
WRITTEN = "written"


class Guarantee(enum.Enum):
    """What a sink promises about each element it is given, across retried bundles, replays and restarts."""

    EXACTLY_ONCE = "exactly-once"  # each element's effect is in the destination once, whatever is replayed
    IDEMPOTENT = "idempotent"  # writing an element again changes nothing: exactly-once given deterministic keys
    AT_LEAST_ONCE = "at-least-once"  # nothing is lost; a replayed element may be written again


@dataclass(frozen=True)
class Declared:
    """A sink's guarantee and what it rests on (the conditions a user must meet for it to hold)."""

    guarantee: Guarantee
    needs: str


class SinkResult(NamedTuple):
    """What every sink transform returns, like Beam's ``WriteResult``.

    ``written``: one report per written batch (a dict with at least ``rows_written``), complete once every element
    is written. ``dead_letters``: the ``DeadLetter`` of every element the sink refused, with its reason.
    """

    written: beam.PCollection
    dead_letters: beam.PCollection


class SinkFn(beam.DoFn):
    """The base of every sink DoFn: override ``open``, ``add``, ``flush`` and ``close`` (see the module docstring).

    ``STAGE`` names the sink in its dead letters.
    """

    GUARANTEE: ClassVar[Declared]
    STAGE: ClassVar[str] = ""
    # The event time (epoch microseconds) of the element ``add`` is called with, for sinks that stamp what they write.
    element_micros: int = 0

    def open(self) -> None:
        """Opens the pool/clients (once per instance)."""

    def add(self, element: Any) -> Iterable[Any]:
        """Buffers ``element``; returns the outputs of anything flushed early (usually nothing)."""
        raise NotImplementedError

    def flush(self) -> Iterable[Any]:
        """Writes everything buffered before returning; returns the outputs."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases what ``open`` opened; may be called after a failed ``open``."""

    def dead_letter(self, element: Any, reason: str, error: str | None = None) -> DeadLetter:
        """A dead letter of this sink for ``element`` (no Kafka coordinates)."""
        return DeadLetter(encode_payload(element), self.STAGE or type(self).__name__, reason, error=error)

    # Beam's life, in terms of the four steps above. Subclasses do not override these.

    def setup(self) -> None:
        self.open()

    def start_bundle(self) -> None:
        self._latest_micros = MIN_TIMESTAMP.micros  # int micros: compared per element in Python

    # The windowed value's int micros, not TimestampParam: Beam resolves each parameter per element through a chain
    # of comparisons (WindowedValueParam comes first) and builds a Timestamp object for TimestampParam. Not a
    # generator: most calls output nothing, and an empty tuple spares a generator's creation and ending per element.
    def process(self, element: Any, windowed: Any = beam.DoFn.WindowedValueParam) -> Iterable[Any]:
        self.element_micros = micros = windowed.timestamp_micros
        if micros > self._latest_micros:
            self._latest_micros = micros
        outputs = self.add(element)
        if not outputs:
            return ()
        return [TaggedOutput(DEAD_LETTERS, out) if isinstance(out, DeadLetter) else out for out in outputs]

    def finish_bundle(self) -> Iterator[Any]:
        latest = Timestamp(micros=self._latest_micros)
        for out in self.flush():
            windowed = in_global_window(out, latest)
            yield TaggedOutput(DEAD_LETTERS, windowed) if isinstance(out, DeadLetter) else windowed

    def teardown(self) -> None:
        self.close()


def write_with(elements: beam.PCollection, fn: SinkFn, label: str = "Write") -> SinkResult:
    """Applies ``fn`` to ``elements`` as step ``label``; its outputs as a ``SinkResult``."""
    outputs = elements | label >> beam.ParDo(fn).with_outputs(DEAD_LETTERS, main=WRITTEN)
    return SinkResult(written=outputs[WRITTEN], dead_letters=outputs[DEAD_LETTERS])
