"""The per-process consumer pool closes what it no longer lends (beamflow/kafka/pool.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from beamflow.kafka.pool import ConsumerPool


class _Consumer:
    """Stands in for a KafkaConsumerClient: the pool only lends it and closes it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lend(pool: ConsumerPool, key: str, made: list[_Consumer]) -> Any:
    def open_consumer() -> Any:
        made.append(_Consumer(key))
        return made[-1]

    with pool.checkout(key, open_consumer) as consumer:
        return consumer


def test_a_consumer_is_reused_while_in_use_and_closed_once_idle_too_long() -> None:
    clock = _Clock()
    pool = ConsumerPool(idle_close_s=60, clock=clock, reap_every_s=0)
    made: list[_Consumer] = []
    first = _lend(pool, "t-0", made)
    clock.now += 59
    assert _lend(pool, "t-0", made) is first  # reused within the idle limit; its idle time starts again
    clock.now += 30
    second = _lend(pool, "t-1", made)
    clock.now += 29
    assert pool.close_idle() == 0 and not first.closed  # t-0 idle 59 s
    clock.now += 1
    assert pool.close_idle() == 1 and first.closed and not second.closed  # t-0 idle 60 s, t-1 30 s
    clock.now += 30
    assert pool.close_idle() == 1 and second.closed and len(pool) == 0


def test_checkout_closes_expired_consumers_of_other_keys_and_opens_a_new_one_for_an_expired_key() -> None:
    clock = _Clock()
    pool = ConsumerPool(idle_close_s=60, clock=clock, reap_every_s=0)
    made: list[_Consumer] = []
    old = _lend(pool, "gone-topic-0", made)
    clock.now += 61
    fresh = _lend(pool, "other-0", made)
    assert old.closed and not fresh.closed
    assert _lend(pool, "gone-topic-0", made) is not old
    assert len(made) == 3


def test_a_failed_use_closes_the_consumer_and_close_empties_the_pool() -> None:
    pool = ConsumerPool(reap_every_s=0)
    made: list[_Consumer] = []
    with pytest.raises(RuntimeError), pool.checkout("k", lambda: made.append(_Consumer("k")) or made[-1]):
        raise RuntimeError("poll failed")
    assert made[0].closed and len(pool) == 0
    kept = _lend(pool, "k", made)
    pool.close()
    assert kept.closed and len(pool) == 0


def test_the_reaper_thread_closes_idle_consumers_without_any_further_checkout() -> None:
    pool = ConsumerPool(idle_close_s=0.2, reap_every_s=0.05)
    made: list[_Consumer] = []
    consumer = _lend(pool, "k", made)
    deadline = time.monotonic() + 10
    while not consumer.closed:
        assert time.monotonic() < deadline, "the reaper never closed the idle consumer"
        time.sleep(0.05)
    assert len(pool) == 0
