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

    A late, repeated or out-of-order finalizer callback (an older bundle, or a worker restored from an older
    checkpoint) must never move the group's offset back: the committed offset is compared with what this process
    committed and with what the broker holds, and only a larger one is written.
    """

    def __init__(self, client: KafkaConsumerClient) -> None:
        self._client = client
        self._known: dict[TopicPartition, int] = {}
        self._lock = threading.Lock()

    def commit(self, tp: TopicPartition, next_offset: int) -> bool:
        with self._lock:
            known = self._known.get(tp)
            if known is None:
                known = self._client.committed(tp)
            if known is not None and next_offset <= known:
                self._known[tp] = known
                return False
            self._client.commit({tp: next_offset})
            self._known[tp] = next_offset
            _LOG.debug("committed %s at %d", tp, next_offset)
            return True
