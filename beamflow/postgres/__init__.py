"""Idempotent PostgreSQL sinks, independent of Beam: batched upserts and HBase-style versioned cells."""

from beamflow.postgres.retry import RetryPolicy
from beamflow.postgres.table import TableSpec, validate_identifier
from beamflow.postgres.writer import PostgresUpsertWriter, WriterStats, open_pool

__all__ = [
    "PostgresUpsertWriter",
    "RetryPolicy",
    "TableSpec",
    "WriterStats",
    "open_pool",
    "validate_identifier",
]
