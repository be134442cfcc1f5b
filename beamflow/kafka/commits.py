"""Forward-only offset commits, shared by every bundle finalizer of a reader in one worker."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from beamflow.kafka.client import KafkaConsumerClient
from beamflow.kafka.record import TopicPartition

__all__ = ["DEFAULT_ROUND_GAP_S", "ForwardOnlyCommitter", "RoundDelayedCommits"]

_LOG = logging.getLogger(__name__)

# A pause between finalizer calls longer than this starts a new finalization round (RoundDelayedCommits); the
# minimum pause between checkpoints must exceed it (beamflow doctor checks).
DEFAULT_ROUND_GAP_S = 1.0


class ForwardOnlyCommitter:
    """Commits ``next offset to read`` per partition, never backwards.

    A late, repeated or out-of-order finalizer callback (an older bundle, a worker restored from an older checkpoint,
    a zombie second job) must never move the group's offset back. Every commit first reads what the broker holds and
    writes only a larger offset. Kafka has no compare-and-set for offsets, so two committers racing inside one
    round trip could still interleave; offsets are for monitoring and for starting new jobs, and the runner's
    checkpoint, not the group offset, is the truth for resuming.
    """

    def __init__(self, client: KafkaConsumerClient) -> None:
        self._client = client
        self._lock = threading.Lock()

    def commit(self, tp: TopicPartition, next_offset: int) -> bool:
        return bool(self.commit_all({tp: next_offset}))

    def commit_all(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Commits every partition of ``offsets`` that moves forward, in ONE commit request; returns those committed.

        One OffsetCommit request is appended to the group's log as one batch, so the broker holds either all of these
        partitions' new offsets or none of them (a crash or a failed request in between cannot commit some
        partitions of a run and not others). Partitions whose committed offset is already at or past the given one
        are left out (forward only).
        """
        with self._lock:
            forward: dict[TopicPartition, int] = {}
            for tp, next_offset in offsets.items():
                current = self._client.committed(tp)
                if current is None or next_offset > current:
                    forward[tp] = next_offset
            if forward:
                self._client.commit(forward)
                _LOG.debug("committed %s", forward)
            return forward


class RoundDelayedCommits:
    """Commits each partition's finalized offsets one finalization round late.

    Why: Beam's portable Flink runner finalizes *every* bundle finished so far when a checkpoint completes
    (``ExecutableStageDoFnOperator.notifyCheckpointComplete`` -> ``finalizeAllOutstandingBundles``), including bundles
    that ran after that checkpoint's barrier. Their records may still be on their way to the sinks, so committing
    their offsets then would put the group ahead of what the sinks hold. The bundles finalized in one round all
    finished before the runner processed that completion notice, which comes before the next checkpoint's barrier;
    when the next round arrives, that next checkpoint has completed, so every sink that commits per bundle holds
    those records. Committing round k's offsets when round k+1 begins is therefore safe.

    A round is a burst of finalizer calls for one partition; a pause longer than ``round_gap_s`` starts the next one.
    Merging two rounds only delays a commit; splitting one would commit early, so keep the gap well below the
    minimum time between checkpoints (``beamflow doctor`` checks the pause) and above any stall inside a burst.
    The newest round is never committed: a restore resumes from the runner's checkpoint, not from the group.
    """

    def __init__(
        self,
        commit: Callable[[TopicPartition, int], object],
        round_gap_s: float = DEFAULT_ROUND_GAP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._commit = commit
        self._gap = round_gap_s
        self._clock = clock
        self._lock = threading.Lock()
        self._current: dict[TopicPartition, int] = {}
        self._last_call: dict[TopicPartition, float] = {}

    def finalized(self, tp: TopicPartition, next_offset: int) -> int | None:
        """Records a finalized bundle's next offset; returns the offset committed now (the previous round's)."""
        with self._lock:
            now = self._clock()
            last = self._last_call.get(tp)
            due: int | None = None
            if last is None or now - last > self._gap:
                due = self._current.get(tp)
                self._current[tp] = next_offset
            else:
                self._current[tp] = max(self._current[tp], next_offset)
            if due is not None:
                self._commit(tp, due)
            # Measured after the commit: a slow commit must not look like a pause between rounds.
            self._last_call[tp] = self._clock()
            return due
