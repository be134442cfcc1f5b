"""Opening a pyiceberg ``SqlCatalog``: SQLite in a data folder by default, or PostgreSQL; a local-folder
warehouse.

SQLite is for development and tests (pyiceberg documents it so); production uses PostgreSQL, whose catalog
commit is a conditional ``UPDATE ... WHERE metadata_location = <old>``, safe across processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy.exc
from pyiceberg.catalog.sql import SqlCatalog

__all__ = ["CatalogConfig", "open_catalog", "postgres_catalog_uri"]


def postgres_catalog_uri(dsn: str) -> str:
    """A ``postgresql://user:pw@host:port/db`` DSN as the SQLAlchemy URI pyiceberg needs (psycopg2)."""
    for prefix in ("postgresql+psycopg2://", "postgresql://", "postgres://"):
        if dsn.startswith(prefix):
            return "postgresql+psycopg2://" + dsn[len(prefix) :]
    raise ValueError(f"not a PostgreSQL DSN: {dsn!r}")


@dataclass(frozen=True)
class CatalogConfig:
    """Where the catalog and the table files live. Plain data, so it pickles into Beam workers.

    ``warehouse``: a local folder (or ``file://`` URI) holding table data and metadata.
    ``uri``: a SQLAlchemy URI (``sqlite:///...`` or ``postgresql+psycopg2://...``; a ``postgresql://`` DSN is
    accepted and converted). Empty means SQLite in ``<warehouse>/catalog.db``.
    """

    warehouse: str
    uri: str = ""
    name: str = "beamflow"
    properties: dict[str, str] = field(default_factory=dict)

    @classmethod
    def local(cls, data_folder: str | Path, name: str = "beamflow") -> CatalogConfig:
        """SQLite catalog and warehouse, both under one data folder."""
        folder = Path(data_folder).resolve()
        return cls(warehouse=str(folder / "warehouse"), uri=f"sqlite:///{folder / 'catalog.db'}", name=name)

    def warehouse_uri(self) -> str:
        if "://" in self.warehouse:
            return self.warehouse
        return Path(self.warehouse).resolve().as_uri()

    def catalog_uri(self) -> str:
        if not self.uri:
            path = Path(self.warehouse.removeprefix("file://")).resolve() / "catalog.db"
            return f"sqlite:///{path}"
        if self.uri.startswith(("postgresql://", "postgres://")):
            return postgres_catalog_uri(self.uri)
        return self.uri


def open_catalog(config: CatalogConfig) -> SqlCatalog:
    """A new catalog handle (own SQLAlchemy engine); creates the warehouse folder and catalog tables."""
    warehouse = config.warehouse_uri()
    if warehouse.startswith("file://"):
        Path(warehouse.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
    uri = config.catalog_uri()
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    props: dict[str, Any] = {"uri": uri, "warehouse": warehouse, **config.properties}
    if uri.startswith("postgresql"):
        # A small pool: one committer per table needs one connection; stale ones are checked before use.
        props.setdefault("pool_pre_ping", "true")
    # Two processes creating the catalog tables at once can collide (CREATE TABLE race); the second try sees
    # them.
    for attempt in range(3):
        try:
            return SqlCatalog(config.name, **props)
        except sqlalchemy.exc.SQLAlchemyError:
            if attempt == 2:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")
