"""Synthetic click traffic with every kind of trouble from the seeds, and an exact account of what was produced.

No Beam. The generator decides every record up front (deterministically from a seed), so a run of the pipeline can be
audited against ``GeneratedTraffic.counts``:

- skew: the top ``hot_user_share`` of users (default 1%) produce ``hot_event_share`` of events (default 22%);
- duplicate sends: a share of events is sent twice with identical bytes (a producer retry);
- late events: a share of events carries an event time ``late_by_ms`` behind the stream's current time; a smaller
  share is later than the allowed lateness (``too_late_by_ms``);
- an idle partition: one partition receives nothing for a stretch of the stream;
- schema v2: from ``v2_from`` (a fraction of the stream) on, events are written with the v2 writer schema;
- bad records: values that cannot be decoded (wrong magic byte, unknown schema id, truncated body, empty, null).
"""

from __future__ import annotations

import random
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BAD_KINDS", "EVENT_ID_FIELDS", "ClickRecord", "GeneratedTraffic", "TrafficSpec", "generate_traffic"]

# The fields that identify one click event: a duplicate send repeats all of them, two distinct events never do.
EVENT_ID_FIELDS = ("user_id", "ad_id", "campaign_id", "event_type", "event_time")
BAD_KINDS = ("bad_magic", "unknown_schema_id", "truncated", "empty", "null_value")

Encoder = Callable[[dict[str, Any], int], bytes]  # (event, schema version 1|2) -> Kafka value bytes


@dataclass(frozen=True)
class TrafficSpec:
    events: int = 10_000
    users: int = 1_000
    partitions: int = 4
    hot_user_share: float = 0.01
    hot_event_share: float = 0.22
    duplicate_share: float = 0.02
    late_share: float = 0.01
    late_by_ms: int = 15 * 60_000
    too_late_share: float = 0.002
    too_late_by_ms: int = 3 * 3600_000
    idle_partition: int | None = 3
    idle_from: float = 0.2
    idle_until: float = 0.6
    v2_from: float | None = 0.5
    bad_per_kind: int = 5
    start_ms: int | None = None  # None: the stream ends about now (idleness and lateness are wall-clock based)
    step_ms: int = 300  # mean event-time spacing; sessions (10-minute gap) form and close within the stream
    seed: int = 7


@dataclass(frozen=True)
class ClickRecord:
    """One Kafka record to produce."""

    partition: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    kind: str  # event | duplicate | bad:<kind>
    event: dict[str, Any] | None = None
    schema_version: int = 1


@dataclass
class GeneratedTraffic:
    records: list[ClickRecord]
    counts: Counter[str] = field(default_factory=Counter)
    per_partition: Counter[int] = field(default_factory=Counter)

    def summary(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


def _partition_of(user_id: str, partitions: int) -> int:
    return zlib.crc32(user_id.encode()) % partitions


def _users(spec: TrafficSpec, rng: random.Random) -> Iterator[str]:
    hot = max(1, round(spec.users * spec.hot_user_share))
    hot_users = [f"u{i:05d}" for i in range(hot)]
    cold_users = [f"u{i:05d}" for i in range(hot, spec.users)]
    while True:
        if rng.random() < spec.hot_event_share or not cold_users:
            yield rng.choice(hot_users)
        else:
            yield rng.choice(cold_users)


def _bad_value(kind: str, rng: random.Random, good: bytes) -> bytes | None:
    if kind == "bad_magic":
        return b"\x07" + good[1:]
    if kind == "unknown_schema_id":
        return b"\x00" + struct.pack(">I", 987_654_321) + good[5:]
    if kind == "truncated":
        return good[: max(6, len(good) // 3)]
    if kind == "empty":
        return b""
    if kind == "null_value":
        return None
    raise ValueError(kind)


def generate_traffic(spec: TrafficSpec, encode: Encoder) -> GeneratedTraffic:
    """Builds the whole stream deterministically; nothing is sent (see ``produce_traffic``)."""
    rng = random.Random(spec.seed)
    users = _users(spec, rng)
    out = GeneratedTraffic(records=[])
    start_ms = spec.start_ms
    if start_ms is None:
        start_ms = int(time.time() * 1000) - spec.events * spec.step_ms
    event_time = start_ms
    sent_events: list[ClickRecord] = []
    bad_every = max(1, spec.events // max(1, spec.bad_per_kind * len(BAD_KINDS) + 1))
    bad_plan = [kind for kind in BAD_KINDS for _ in range(spec.bad_per_kind)]
    for i in range(spec.events):
        event_time += rng.randint(1, 2 * spec.step_ms - 1)  # strictly increasing: distinct events never collide
        user = next(users)
        position = i / spec.events
        version = 2 if spec.v2_from is not None and position >= spec.v2_from else 1
        roll = rng.random()
        when = event_time
        kind = "event"
        if roll < spec.too_late_share:
            when, kind = event_time - spec.too_late_by_ms, "too_late"
        elif roll < spec.too_late_share + spec.late_share:
            when, kind = event_time - spec.late_by_ms, "late"
        event: dict[str, Any] = {
            "user_id": user,
            "ad_id": f"ad{rng.randint(0, 499):03d}",
            "campaign_id": f"c{rng.randint(0, 19):02d}",
            "event_type": "click" if rng.random() < 0.1 else "impression",
            "event_time": when,
        }
        if version == 2:
            event["device"] = rng.choice(["ios", "android", "web"])
            event["country"] = rng.choice(["DE", "US", "BR", "IN", None])
        partition = _partition_of(user, spec.partitions)
        idle = spec.idle_partition
        if idle is not None and spec.idle_from <= position < spec.idle_until and partition == idle:
            partition = (idle + 1) % spec.partitions
        record = ClickRecord(partition, user.encode(), encode(event, version), when, "event", event, version)
        out.records.append(record)
        sent_events.append(record)
        out.counts["events"] += 1
        out.counts[f"events_v{version}"] += 1
        if kind != "event":
            out.counts[f"{kind}_events"] += 1
        out.per_partition[partition] += 1
        if rng.random() < spec.duplicate_share:
            out.records.append(ClickRecord(partition, record.key, record.value, when, "duplicate", event, version))
            out.counts["duplicate_sends"] += 1
            out.per_partition[partition] += 1
        if bad_plan and i % bad_every == bad_every - 1:
            bad_kind = bad_plan.pop()
            value = _bad_value(bad_kind, rng, record.value or b"")
            bad_partition = (partition + 1) % spec.partitions
            if idle is not None and spec.idle_from <= position < spec.idle_until and bad_partition == idle:
                bad_partition = (idle + 1) % spec.partitions
            out.records.append(ClickRecord(bad_partition, b"bad", value, event_time, f"bad:{bad_kind}"))
            out.counts["bad_records"] += 1
            out.counts[f"bad:{bad_kind}"] += 1
            out.per_partition[bad_partition] += 1
    out.counts["records"] = len(out.records)
    return out


def produce_traffic(bootstrap: str, topic: str, traffic: GeneratedTraffic, rate: float | None = None) -> int:
    """Sends the generated records in order with acks=all and idempotence; returns how many the broker acked.

    ``rate`` (records/s) paces the sending, for a stream a running job consumes live; None sends as fast as possible.
    """
    from beamflow.kafka.admin import produce

    def paced() -> Iterator[tuple[bytes | None, bytes | None, dict[str, Any]]]:
        start = time.monotonic()
        for i, r in enumerate(traffic.records):
            if rate:
                ahead = i / rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
            yield (r.key, r.value, {"partition": r.partition, "timestamp_ms": r.timestamp_ms})

    return produce(bootstrap, topic, paced())


def load_click_schema(version: int) -> dict[str, Any]:
    import json
    from pathlib import Path

    return dict(json.loads((Path(__file__).parent / "avro" / "schemas" / f"click_v{version}.avsc").read_text()))


def avro_click_encoder(registry_url: str, subject: str) -> Encoder:
    """Encodes events in the Confluent wire format with the click schema v1 or v2, registered under ``subject``."""
    from beamflow.avro.registry import SchemaRegistryClient
    from beamflow.avro.serde import AvroSerializer

    client = SchemaRegistryClient(registry_url)
    serializers = {v: AvroSerializer(client, subject, load_click_schema(v)) for v in (1, 2)}

    def encode(event: dict[str, Any], version: int) -> bytes:
        return serializers[version].serialize(event)

    return encode
