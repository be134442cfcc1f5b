"""Synthetic traffic (click events, ride events) with every kind of trouble from the seeds, and an exact account of
what was produced.

No Beam. The generator decides every record up front (deterministically from a seed), so a run of the pipeline can be
audited against ``GeneratedTraffic.counts``:

- skew: the top ``hot_user_share`` of keys (users; drivers for rides, default 1%) produce ``hot_event_share`` of
  events (default 22%);
- duplicate sends: a share of events is sent twice with identical bytes (a producer retry);
- late events: a share of events carries an event time ``late_by_ms`` behind the stream's current time; a smaller
  share is later than the allowed lateness (``too_late_by_ms``);
- an idle partition: one partition receives nothing for a stretch of the stream;
- schema v2 (clicks): from ``v2_from`` (a fraction of the stream) on, events are written with the v2 writer schema;
- unknown dimension keys (rides, ``RideTrafficSpec``): a share of rides names a driver, and another share a zone, that
  the dimension tables (``ride_dimensions``, ``seed_ride_dimensions``) do not hold;
- bad records: values that cannot be decoded (wrong magic byte, unknown schema id, truncated body, empty, null).

Clicks (``TrafficSpec``) carry their event time as the Kafka record timestamp. Rides (``RideTrafficSpec``) carry the
stream's current time there (when the ride was sent), so a ride's lateness is in the record itself: record timestamp
minus event time.
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

__all__ = [
    "BAD_KINDS",
    "EVENT_ID_FIELDS",
    "RIDE_EVENT_ID_FIELDS",
    "ClickRecord",
    "GeneratedTraffic",
    "RideDimensions",
    "RideTrafficSpec",
    "TrafficSpec",
    "avro_click_encoder",
    "avro_ride_encoder",
    "generate_traffic",
    "load_click_schema",
    "load_ride_schema",
    "produce_traffic",
    "ride_dimensions",
    "seed_ride_dimensions",
]

# The fields that identify one click event: a duplicate send repeats all of them, two distinct events never do.
EVENT_ID_FIELDS = ("user_id", "ad_id", "campaign_id", "event_type", "event_time")
# A ride's id is given by the producer (a duplicate send repeats it); the driver and event time make a reused id of
# another ride a different event.
RIDE_EVENT_ID_FIELDS = ("ride_id", "driver_id", "event_time")
BAD_KINDS = ("bad_magic", "unknown_schema_id", "truncated", "empty", "null_value")

Encoder = Callable[[dict[str, Any], int], bytes]  # (event, schema version 1|2) -> Kafka value bytes


@dataclass(frozen=True)
class TrafficSpec:
    """Click traffic (seed 000). ``users`` is the number of distinct keys."""

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
class RideTrafficSpec(TrafficSpec):
    """Ride traffic (seed 002): ``users`` are the drivers (``d00000``...), ``zones`` the pickup zones (``z000``...).

    ``unknown_driver_share`` of rides name a driver, and ``unknown_zone_share`` a zone, that ``ride_dimensions``
    does not hold (``dx...``/``zx...`` ids). One writer schema (``ride_v1``): ``v2_from`` must stay None.
    """

    users: int = 500
    zones: int = 40
    unknown_driver_share: float = 0.01
    unknown_zone_share: float = 0.01
    v2_from: float | None = None

    def __post_init__(self) -> None:
        if self.v2_from is not None:
            raise ValueError("ride traffic has one writer schema (ride_v1): v2_from must be None")


@dataclass(frozen=True)
class ClickRecord:
    """One Kafka record to produce (a click or a ride event, a duplicate send, or a bad record)."""

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


def _users(spec: TrafficSpec, rng: random.Random, prefix: str = "u") -> Iterator[str]:
    hot = max(1, round(spec.users * spec.hot_user_share))
    hot_users = [f"{prefix}{i:05d}" for i in range(hot)]
    cold_users = [f"{prefix}{i:05d}" for i in range(hot, spec.users)]
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


def _click_event(spec: TrafficSpec, rng: random.Random, user: str, when: int, version: int) -> dict[str, Any]:
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
    return event


def _ride_event(spec: RideTrafficSpec, rng: random.Random, driver: str, when: int, version: int) -> dict[str, Any]:
    if rng.random() < spec.unknown_driver_share:
        driver = f"dx{rng.randint(0, 99):03d}"
    zone = f"zx{rng.randint(0, 9)}" if rng.random() < spec.unknown_zone_share else f"z{rng.randrange(spec.zones):03d}"
    return {
        "ride_id": f"{rng.getrandbits(64):016x}",
        "driver_id": driver,
        "zone_id": zone,
        "fare": round(rng.uniform(4.0, 60.0), 2),
        "distance_km": round(rng.uniform(0.5, 25.0), 2),
        "event_time": when,
    }


def generate_traffic(spec: TrafficSpec, encode: Encoder) -> GeneratedTraffic:
    """Builds the whole stream deterministically; nothing is sent (see ``produce_traffic``).

    A ``RideTrafficSpec`` builds ride events (keyed and partitioned by driver, with unknown dimension keys, the
    record timestamp the time of sending); a ``TrafficSpec`` click events (keyed by user, the record timestamp the
    event time). Counts: ``events``, ``events_v<n>``, ``late_events``, ``too_late_events``, ``duplicate_sends``,
    ``bad_records`` and ``bad:<kind>``, and for rides ``unknown_driver_events``/``unknown_zone_events``.
    """
    rides = isinstance(spec, RideTrafficSpec)
    rng = random.Random(spec.seed)
    users = _users(spec, rng, "d" if rides else "u")
    key_field = "driver_id" if rides else "user_id"
    out = GeneratedTraffic(records=[])
    start_ms = spec.start_ms
    if start_ms is None:
        start_ms = int(time.time() * 1000) - spec.events * spec.step_ms
    event_time = start_ms
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
        if isinstance(spec, RideTrafficSpec):
            event = _ride_event(spec, rng, user, when, version)
            out.counts["unknown_driver_events"] += event["driver_id"].startswith("dx")
            out.counts["unknown_zone_events"] += event["zone_id"].startswith("zx")
        else:
            event = _click_event(spec, rng, user, when, version)
        key = event[key_field]
        # A ride's record says when it was sent (its lateness is then in the record); a click's, when it happened.
        sent_ms = event_time if rides else when
        partition = _partition_of(key, spec.partitions)
        idle = spec.idle_partition
        if idle is not None and spec.idle_from <= position < spec.idle_until and partition == idle:
            partition = (idle + 1) % spec.partitions
        record = ClickRecord(partition, key.encode(), encode(event, version), sent_ms, "event", event, version)
        out.records.append(record)
        out.counts["events"] += 1
        out.counts[f"events_v{version}"] += 1
        if kind != "event":
            out.counts[f"{kind}_events"] += 1
        out.per_partition[partition] += 1
        if rng.random() < spec.duplicate_share:
            out.records.append(ClickRecord(partition, record.key, record.value, sent_ms, "duplicate", event, version))
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


@dataclass(frozen=True)
class RideDimensions:
    """The driver and zone dimension rows of a ride spec's keys (the unknown ``dx``/``zx`` keys are not among them)."""

    drivers: list[dict[str, Any]]
    zones: list[dict[str, Any]]

    DRIVER_COLUMNS = ("driver_name", "rating", "vehicle")
    ZONE_COLUMNS = ("zone_name", "borough")


def ride_dimensions(spec: RideTrafficSpec) -> RideDimensions:
    """The dimension rows for ``spec.users`` drivers and ``spec.zones`` zones: fixed by those counts alone (not by
    the traffic's seed), so every batch of a stream finds the same rows."""
    rng = random.Random(f"dimensions-{spec.users}-{spec.zones}")
    names = ["Ada", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lea"]
    vehicles = ["sedan", "hatchback", "van", "suv", "e-bike"]
    boroughs = ["north", "south", "east", "west", "centre"]
    drivers = [
        {
            "driver_id": f"d{i:05d}",
            "driver_name": f"{rng.choice(names)} {i}",
            "rating": round(rng.uniform(3.5, 5.0), 2),
            "vehicle": rng.choice(vehicles),
        }
        for i in range(spec.users)
    ]
    zones = [
        {"zone_id": f"z{i:03d}", "zone_name": f"zone {i}", "borough": boroughs[i % len(boroughs)]}
        for i in range(spec.zones)
    ]
    return RideDimensions(drivers, zones)


def seed_ride_dimensions(dsn: str, dimensions: RideDimensions, drivers_table: str, zones_table: str) -> None:
    """Creates the two dimension tables if missing and upserts ``dimensions`` into them (idempotent)."""
    import psycopg
    from psycopg import sql

    tables: tuple[tuple[str, str, list[dict[str, Any]], dict[str, str]], ...] = (
        (drivers_table, "driver_id", dimensions.drivers, {"rating": "real"}),
        (zones_table, "zone_id", dimensions.zones, {}),
    )
    with psycopg.connect(dsn) as conn:
        for table, key, rows, types in tables:
            columns = list(rows[0]) if rows else [key]
            conn.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                    sql.Identifier(table),
                    sql.SQL(", ").join(
                        sql.SQL("{} {}").format(
                            sql.Identifier(c), sql.SQL("text PRIMARY KEY" if c == key else types.get(c, "text"))
                        )
                        for c in columns
                    ),
                )
            )
            upsert = sql.SQL("INSERT INTO {} ({}) VALUES ({}) ON CONFLICT ({}) DO UPDATE SET {}").format(
                sql.Identifier(table),
                sql.SQL(", ").join(map(sql.Identifier, columns)),
                sql.SQL(", ").join(sql.Placeholder() * len(columns)),
                sql.Identifier(key),
                sql.SQL(", ").join(
                    sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in columns if c != key
                ),
            )
            with conn.cursor() as cur:
                cur.executemany(upsert, [[row[c] for c in columns] for row in rows])


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


def _load_schema(name: str) -> dict[str, Any]:
    import json
    from pathlib import Path

    return dict(json.loads((Path(__file__).parent / "avro" / "schemas" / f"{name}.avsc").read_text()))


def load_click_schema(version: int) -> dict[str, Any]:
    return _load_schema(f"click_v{version}")


def load_ride_schema() -> dict[str, Any]:
    return _load_schema("ride_v1")


def _avro_encoder(
    registry_url: str, subject: str, schemas: dict[int, dict[str, Any]], ca_file: str | None = None
) -> Encoder:
    from beamflow.avro.registry import SchemaRegistryClient
    from beamflow.avro.serde import AvroSerializer

    client = SchemaRegistryClient(registry_url, ca_file=ca_file)
    serializers = {v: AvroSerializer(client, subject, schema) for v, schema in schemas.items()}

    def encode(event: dict[str, Any], version: int) -> bytes:
        return serializers[version].serialize(event)

    return encode


def avro_click_encoder(registry_url: str, subject: str, ca_file: str | None = None) -> Encoder:
    """Encodes events in the Confluent wire format with the click schema v1 or v2, registered under ``subject``
    (an ``https://`` registry verified with ``ca_file``)."""
    return _avro_encoder(registry_url, subject, {v: load_click_schema(v) for v in (1, 2)}, ca_file)


def avro_ride_encoder(registry_url: str, subject: str, ca_file: str | None = None) -> Encoder:
    """Encodes ride events in the Confluent wire format with the ride schema, registered under ``subject`` (an
    ``https://`` registry verified with ``ca_file``)."""
    return _avro_encoder(registry_url, subject, {1: load_ride_schema()}, ca_file)
