"""Sets of Kafka offsets (per partition of one topic), kept small as ranges: which records an aggregate holds.

A session row stores the offsets of the events it counts, so that merging it with new partial sessions can count
each event once, even when a rerun reads events the stored row already counts (a crash between the sinks and the
offset commit, a restored streaming job replaying). Text form, as stored: ``"0:100-180,190;2:5-9"`` (partition,
then inclusive ranges and single offsets, partitions ascending). Beam-free.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["OffsetRanges"]


class OffsetRanges:
    """An immutable set of (partition, offset), stored as sorted, disjoint, non-adjacent inclusive ranges.

    ``len()`` is the number of offsets. ``add`` is cheap when offsets come in ascending order per partition (the
    common case: one user's events in read order); ``union`` merges two sets in linear time.
    """

    __slots__ = ("_ranges",)

    def __init__(self, ranges: Iterable[tuple[int, int, int]] = ()) -> None:
        self._ranges: tuple[tuple[int, int, int], ...] = _normalize(ranges)

    @classmethod
    def _of(cls, ranges: tuple[tuple[int, int, int], ...]) -> OffsetRanges:
        out = cls.__new__(cls)
        out._ranges = ranges
        return out

    @classmethod
    def of(cls, coordinates: Iterable[tuple[int, int]]) -> OffsetRanges:
        """From (partition, offset) pairs in any order."""
        return cls((p, o, o) for p, o in coordinates)

    @property
    def ranges(self) -> tuple[tuple[int, int, int], ...]:
        """(partition, first, last) inclusive, sorted."""
        return self._ranges

    def add(self, partition: int, offset: int) -> OffsetRanges:
        ranges = self._ranges
        if not ranges:
            return OffsetRanges._of(((partition, offset, offset),))
        p, lo, hi = ranges[-1]
        if p == partition and offset == hi + 1:
            return OffsetRanges._of((*ranges[:-1], (p, lo, offset)))
        if p < partition or (p == partition and offset > hi + 1):
            return OffsetRanges._of((*ranges, (partition, offset, offset)))
        return self.union(OffsetRanges._of(((partition, offset, offset),)))

    def union(self, other: OffsetRanges) -> OffsetRanges:
        if not other._ranges:
            return self
        if not self._ranges:
            return other
        return OffsetRanges._of(_normalize(sorted((*self._ranges, *other._ranges))))

    def __or__(self, other: OffsetRanges) -> OffsetRanges:
        return self.union(other)

    def __contains__(self, coordinate: object) -> bool:
        if not isinstance(coordinate, tuple) or len(coordinate) != 2:
            return False
        partition, offset = coordinate
        return any(p == partition and lo <= offset <= hi for p, lo, hi in self._ranges)

    def __len__(self) -> int:
        return sum(hi - lo + 1 for _, lo, hi in self._ranges)

    def __bool__(self) -> bool:
        return bool(self._ranges)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OffsetRanges) and self._ranges == other._ranges

    def __hash__(self) -> int:
        return hash(self._ranges)

    def __repr__(self) -> str:
        return f"OffsetRanges({self.encode()!r})"

    def __reduce__(self) -> tuple[object, tuple[tuple[tuple[int, int, int], ...]]]:
        return (_restore, (self._ranges,))

    def encode(self) -> str:
        """``"0:100-180,190;2:5-9"``; the empty set is ``""``."""
        parts: list[str] = []
        current: int | None = None
        spans: list[str] = []
        for p, lo, hi in self._ranges:
            if p != current:
                if current is not None:
                    parts.append(f"{current}:{','.join(spans)}")
                current, spans = p, []
            spans.append(str(lo) if lo == hi else f"{lo}-{hi}")
        if current is not None:
            parts.append(f"{current}:{','.join(spans)}")
        return ";".join(parts)

    @classmethod
    def decode(cls, text: str | None) -> OffsetRanges:
        """The inverse of ``encode``; None or ``""`` is the empty set. Raises ValueError on anything else."""
        if not text:
            return cls()
        ranges: list[tuple[int, int, int]] = []
        try:
            for part in text.split(";"):
                partition, _, spans = part.partition(":")
                p = int(partition)
                for span in spans.split(","):
                    lo, dash, hi = span.partition("-")
                    ranges.append((p, int(lo), int(hi) if dash else int(lo)))
        except ValueError as exc:
            raise ValueError(f"not an offset range list: {text!r} (expected e.g. '0:100-180,190;2:5-9')") from exc
        return cls(ranges)


def _restore(ranges: tuple[tuple[int, int, int], ...]) -> OffsetRanges:
    return OffsetRanges._of(ranges)


def _normalize(ranges: Iterable[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    out: list[tuple[int, int, int]] = []
    for p, lo, hi in sorted(ranges):
        if lo > hi:
            raise ValueError(f"empty offset range {lo}-{hi} in partition {p}")
        if out and out[-1][0] == p and lo <= out[-1][2] + 1:
            if hi > out[-1][2]:
                out[-1] = (p, out[-1][1], hi)
        else:
            out.append((p, lo, hi))
    return tuple(out)
