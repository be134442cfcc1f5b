"""Exactly-once Iceberg writes from Python (pyiceberg SQL catalog): catalog config, committer, maintenance,
audit.

Nothing here imports Beam; ``transforms/write_to_iceberg.py`` wraps the committer for pipelines.
"""

from __future__ import annotations

from beamflow.iceberg.catalog import CatalogConfig, open_catalog

__all__ = ["CatalogConfig", "open_catalog"]
