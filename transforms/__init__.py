"""beamflow's public PTransforms, one per module, importable from here: ``from transforms import ReadFromKafka``.

Names are resolved on first use (PEP 562), so ``import transforms.read_from_kafka`` does not import every transform
(and pyiceberg, psycopg, confluent-kafka with them) into a worker that needs one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transforms.attach_event_id import AttachEventId, EventIdResult
    from transforms.commit_offsets_after import CommitOffsetsAfter
    from transforms.decode_avro import DecodeAvro, DecodeAvroResult
    from transforms.deduplicate import DeduplicateEvents, DeduplicateResult, FirstCopyTable, QuarantinedEvent
    from transforms.enrich import Enrich, EnrichResult
    from transforms.hot_key_aggregate import HotKeyAggregate, HotKeyDetection, WindowedAggregate, late_dropped
    from transforms.read_from_kafka import ReadFromKafka, StartPolicy, StopPolicy
    from transforms.sink_base import Declared, Guarantee, SinkFn, SinkResult
    from transforms.write_dead_letters import WriteDeadLetters
    from transforms.write_sessions import WriteSessions
    from transforms.write_to_iceberg import WriteToIceberg
    from transforms.write_to_kafka import WriteToKafka
    from transforms.write_to_postgres import WriteToPostgres
    from transforms.write_versioned_cells import WriteVersionedCells

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "AttachEventId": "attach_event_id",
    "EventIdResult": "attach_event_id",
    "CommitOffsetsAfter": "commit_offsets_after",
    "DecodeAvro": "decode_avro",
    "DecodeAvroResult": "decode_avro",
    "DeduplicateEvents": "deduplicate",
    "DeduplicateResult": "deduplicate",
    "FirstCopyTable": "deduplicate",
    "QuarantinedEvent": "deduplicate",
    "Enrich": "enrich",
    "EnrichResult": "enrich",
    "HotKeyAggregate": "hot_key_aggregate",
    "HotKeyDetection": "hot_key_aggregate",
    "WindowedAggregate": "hot_key_aggregate",
    "late_dropped": "hot_key_aggregate",
    "ReadFromKafka": "read_from_kafka",
    "StartPolicy": "read_from_kafka",
    "StopPolicy": "read_from_kafka",
    "Declared": "sink_base",
    "Guarantee": "sink_base",
    "SinkFn": "sink_base",
    "SinkResult": "sink_base",
    "WriteDeadLetters": "write_dead_letters",
    "WriteSessions": "write_sessions",
    "WriteToIceberg": "write_to_iceberg",
    "WriteToKafka": "write_to_kafka",
    "WriteToPostgres": "write_to_postgres",
    "WriteVersionedCells": "write_versioned_cells",
}

__all__ = [
    "AttachEventId",
    "CommitOffsetsAfter",
    "Declared",
    "DecodeAvro",
    "DecodeAvroResult",
    "DeduplicateEvents",
    "DeduplicateResult",
    "Enrich",
    "EnrichResult",
    "EventIdResult",
    "FirstCopyTable",
    "Guarantee",
    "HotKeyAggregate",
    "HotKeyDetection",
    "QuarantinedEvent",
    "ReadFromKafka",
    "SinkFn",
    "SinkResult",
    "StartPolicy",
    "StopPolicy",
    "WindowedAggregate",
    "WriteDeadLetters",
    "WriteSessions",
    "WriteToIceberg",
    "WriteToKafka",
    "WriteToPostgres",
    "WriteVersionedCells",
    "late_dropped",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'transforms' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"transforms.{module}"), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
