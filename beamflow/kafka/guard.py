"""One live reader per partition per consumer group inside a worker process.

beam#31313 and #34890: after a Flink restore, a second reader of the same Kafka partition appeared and every message
was read twice. beamflow's restrictions cannot be split (see the read transform), so two live readers of one partition
in one group can only be such a bug: the second is refused loudly instead of duplicating data silently.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["DuplicateReaderError", "exclusive_reader"]

_LIVE: dict[tuple[str, str, str, int], int] = {}
_LOCK = threading.Lock()


class DuplicateReaderError(RuntimeError):
    """A second live reader of a partition that another thread of this worker is reading for the same group."""


@contextmanager
def exclusive_reader(bootstrap: str, group_id: str, topic: str, partition: int) -> Iterator[None]:
    key = (bootstrap, group_id, topic, partition)
    me = threading.get_ident()
    with _LOCK:
        holder = _LIVE.get(key)
        if holder is not None and holder != me:
            raise DuplicateReaderError(
                f"partition {topic}-{partition} of group {group_id} is already being read by thread {holder} in this "
                "worker; refusing a second reader (it would emit every record twice)"
            )
        _LIVE[key] = me
    try:
        yield
    finally:
        with _LOCK:
            if _LIVE.get(key) == me:
                del _LIVE[key]
