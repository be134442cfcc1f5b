"""Forward-only offset commits, shared by every bundle finalizer of a reader in one worker."""

from __future__ import annotations

import logging
import threading

from beamflow.kafka.client import KafkaConsumerClient
from beamflow.kafka.record import TopicPartition

__all__ = ["ForwardOnlyCommitter"]

_LOG = logging.getLogger(__name__)


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
        with self._lock:
            current = self._client.committed(tp)
            if current is not None and next_offset <= current:
                return False
            self._client.commit({tp: next_offset})
            _LOG.debug("committed %s at %d (was %s)", tp, next_offset, current)
            return True
