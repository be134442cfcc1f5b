"""The traffic generator produces exactly what it says it produced, with the trouble it was asked for."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from beamflow.generate import TrafficSpec, generate_traffic

pytestmark = pytest.mark.unit


def _encode(event: dict[str, Any], version: int) -> bytes:
    # A stand-in value encoding; the Avro path is exercised against the real registry in the e2e test.
    return json.dumps({"v": version, **event}).encode()


def test_counts_skew_idle_partition_and_schema_switch() -> None:
    spec = TrafficSpec(events=20_000, users=1_000, partitions=4, start_ms=1_767_225_600_000, seed=3)
    traffic = generate_traffic(spec, _encode)
    counts = traffic.counts
    assert counts["records"] == len(traffic.records)
    assert counts["records"] == counts["events"] + counts["duplicate_sends"] + counts["bad_records"]
    assert counts["bad_records"] == 5 * spec.bad_per_kind
    assert 0.01 < counts["duplicate_sends"] / spec.events < 0.03

    events = [r for r in traffic.records if r.kind == "event"]
    per_user = Counter(r.event["user_id"] for r in events if r.event)
    hot = sum(n for _, n in per_user.most_common(10))  # the top 1% of 1,000 users
    assert 0.19 < hot / len(events) < 0.25

    # The idle partition gets nothing during its idle stretch, and data before and after it.
    idle = [i for i, r in enumerate(events) if r.partition == spec.idle_partition]
    start, end = int(spec.idle_from * spec.events), int(spec.idle_until * spec.events)
    assert idle and not [i for i in idle if start <= i < end]
    assert min(idle) < start and max(idle) >= end

    assert [r.schema_version for r in events[:10_000]] == [1] * 10_000
    assert {r.schema_version for r in events[10_000:]} == {2}
    # Duplicate sends repeat the original's bytes exactly; distinct events never share identifying fields.
    originals = {r.value for r in events}
    assert all(r.value in originals for r in traffic.records if r.kind == "duplicate")
    ids = Counter(tuple(r.event[f] for f in ("user_id", "ad_id", "event_time")) for r in events if r.event)
    assert max(ids.values()) == 1


def test_same_seed_same_stream() -> None:
    spec = TrafficSpec(events=500, start_ms=0, seed=9)
    assert generate_traffic(spec, _encode).records == generate_traffic(spec, _encode).records
