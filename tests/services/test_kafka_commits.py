"""Offsets move only forward, whichever process or callback order asks."""

from __future__ import annotations

import uuid

import pytest

from beamflow.kafka.admin import create_topic, produce
from beamflow.kafka.client import BACKENDS, open_consumer
from beamflow.kafka.commits import ForwardOnlyCommitter
from beamflow.kafka.record import TopicPartition
from beamflow.services import ServiceState

pytestmark = pytest.mark.services


@pytest.mark.parametrize("backend", BACKENDS)
def test_late_and_repeated_commits_never_move_the_group_back(kafka: ServiceState, backend: str) -> None:
    bootstrap = kafka.info["bootstrap"]
    topic, group = f"commits-{uuid.uuid4().hex[:6]}", f"g-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic, 1)
    produce(bootstrap, topic, ((None, b"x") for _ in range(200)))
    tp = TopicPartition(topic, 0)
    client = open_consumer(backend, bootstrap, group)
    try:
        committer = ForwardOnlyCommitter(client)
        assert committer.commit(tp, 100) is True
        assert committer.commit(tp, 50) is False  # a late callback of an older bundle
        assert committer.commit(tp, 100) is False  # a repeated callback
        assert client.committed(tp) == 100
        # A fresh process (a worker restored from an older checkpoint) reads the broker's value first.
        other = open_consumer(backend, bootstrap, group)
        try:
            assert ForwardOnlyCommitter(other).commit(tp, 60) is False
            assert other.committed(tp) == 100
            assert ForwardOnlyCommitter(other).commit(tp, 150) is True
        finally:
            other.close()
        assert committer.commit(tp, 120) is False  # the broker moved on to 150
        assert client.committed(tp) == 150
    finally:
        client.close()
