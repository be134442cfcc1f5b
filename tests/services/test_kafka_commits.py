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


class _DiesAfterOneCommit:
    """The real client, in a process that dies right after its first commit request (as a SIGKILL would)."""

    def __init__(self, client: object) -> None:
        self._client = client
        self.requests = 0

    def committed(self, tp: TopicPartition, timeout_s: float = 10.0) -> int | None:
        return self._client.committed(tp, timeout_s)  # type: ignore[attr-defined,no-any-return]

    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        if self.requests:
            raise SystemExit("killed after the first commit request")
        self.requests += 1
        self._client.commit(offsets)  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_commits_every_partition_in_one_request_all_or_none(kafka: ServiceState, backend: str) -> None:
    bootstrap = kafka.info["bootstrap"]
    topic = f"commits-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic, 4)
    produce(bootstrap, topic, ((None, b"x", {"partition": i % 4}) for i in range(400)))
    run = {TopicPartition(topic, p): 100 for p in range(4)}

    def broker(group: str) -> dict[int, int | None]:
        reader = open_consumer(backend, bootstrap, group)
        try:
            return {tp.partition: reader.committed(tp) for tp in run}
        finally:
            reader.close()

    # One partition at a time (what CommitOffsetsAfter did): a death after the first leaves a run half committed.
    per_partition = f"g-{uuid.uuid4().hex[:6]}"
    client = open_consumer(backend, bootstrap, per_partition)
    try:
        dying = _DiesAfterOneCommit(client)
        committer = ForwardOnlyCommitter(dying)  # type: ignore[arg-type]
        with pytest.raises(SystemExit):
            for tp, offset in run.items():
                committer.commit(tp, offset)
    finally:
        client.close()
    assert broker(per_partition) == {0: 100, 1: None, 2: None, 3: None}

    # commit_all: one request for the whole run, so the same death leaves all four committed (or, before it, none).
    whole = f"g-{uuid.uuid4().hex[:6]}"
    client = open_consumer(backend, bootstrap, whole)
    try:
        dying = _DiesAfterOneCommit(client)
        assert ForwardOnlyCommitter(dying).commit_all(run) == run  # type: ignore[arg-type]
        assert dying.requests == 1
        # Forward only, per partition: a later run moves some partitions, never one back.
        assert ForwardOnlyCommitter(client).commit_all({**run, TopicPartition(topic, 0): 50}) == {}
        moved = {TopicPartition(topic, 0): 50, TopicPartition(topic, 1): 120}
        assert ForwardOnlyCommitter(client).commit_all(moved) == {TopicPartition(topic, 1): 120}
    finally:
        client.close()
    assert broker(whole) == {0: 100, 1: 120, 2: 100, 3: 100}
