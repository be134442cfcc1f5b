"""Per-partition event-time watermark with idleness, as plain logic (the Beam estimator wraps it).

The watermark trails the newest record timestamp seen by ``max_delay_ms`` (bounded out-of-orderness) and never moves
back. Idleness (seed 002, question 3): a partition with nothing to read for ``idle_timeout_ms`` of wall time advances
to ``now - max_delay_ms``, including one that has never had a record (Beam Java's KafkaIO only does this after a first
record, beam#20908). The trade-off: a record that arrives on such a partition later with an older timestamp is late
for windows that already fired; the reader counts those records (``late_records``), and allowed lateness downstream
decides whether they still update results.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIN_WATERMARK_MS", "PartitionWatermark"]

MIN_WATERMARK_MS = -(2**62)


@dataclass
class PartitionWatermark:
    max_delay_ms: int
    idle_timeout_ms: int | None
    watermark_ms: int = MIN_WATERMARK_MS
    last_activity_wall_ms: int | None = None

    def observe_record(self, timestamp_ms: int, now_ms: int) -> bool:
        """Accounts for one record; returns True if it is late (older than the watermark already published)."""
        late = timestamp_ms < self.watermark_ms
        self.watermark_ms = max(self.watermark_ms, timestamp_ms - self.max_delay_ms)
        self.last_activity_wall_ms = now_ms
        return late

    def observe_caught_up(self, now_ms: int) -> bool:
        """Called when a poll found nothing to read; returns True if the partition now counts as idle."""
        if self.last_activity_wall_ms is None:
            self.last_activity_wall_ms = now_ms
        if self.idle_timeout_ms is None or now_ms - self.last_activity_wall_ms < self.idle_timeout_ms:
            return False
        self.watermark_ms = max(self.watermark_ms, now_ms - self.max_delay_ms)
        return True

    def as_state(self) -> tuple[int, int | None]:
        return (self.watermark_ms, self.last_activity_wall_ms)
