"""Pure parts of the Iceberg sink: marks arithmetic, coordinate handling, catalog config, CLI wiring."""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from beamflow.cli import iceberg as iceberg_cli
from beamflow.iceberg.catalog import CatalogConfig, postgres_catalog_uri
from beamflow.iceberg.committer import (
    CoordinateFields,
    batch_marks,
    decode_marks,
    encode_marks,
    marks_property,
    merge_marks,
    rows_to_arrow,
)

pytestmark = pytest.mark.unit

marks_strategy = st.dictionaries(
    st.sampled_from(["a", "b", "c"]),
    st.dictionaries(st.integers(0, 5), st.integers(0, 10_000), max_size=4),
    max_size=3,
)


@given(marks_strategy, marks_strategy)
def test_merged_marks_never_move_backwards(old: dict[str, dict[int, int]], new: dict[str, dict[int, int]]) -> None:
    merged = merge_marks(old, new)
    for source in (old, new):
        for topic, parts in source.items():
            for partition, offset in parts.items():
                assert merged[topic][partition] >= offset
    assert merge_marks(new, old) == merged
    assert decode_marks(encode_marks(merged)) == {t: p for t, p in merged.items()}


def test_batch_marks_take_the_highest_offset_per_partition() -> None:
    rows = rows_to_arrow(
        [
            {"id": 1, "_kafka": {"topic": "t", "partition": 0, "offset": 7}},
            {"id": 2, "_kafka": {"topic": "t", "partition": 0, "offset": 3}},
            {"id": 3, "_kafka": {"topic": "t", "partition": 1, "offset": 0}},
            {"id": 4, "_kafka": {"topic": "u", "partition": 0, "offset": 9}},
        ]
    )
    assert rows.column_names == ["id", "topic", "partition", "offset"]
    assert rows.schema.field("offset").type == pa.int64()
    assert batch_marks(rows) == {"t": {0: 7, 1: 0}, "u": {0: 9}}


def test_custom_coordinate_field_names() -> None:
    fields = CoordinateFields(topic="kt", partition="kp", offset="ko")
    rows = rows_to_arrow([{"kt": "x", "kp": 2, "ko": 11}, {"kt": "x", "kp": 2, "ko": 12}], fields)
    assert batch_marks(rows, fields) == {"x": {2: 12}}


@pytest.mark.parametrize("bad", ["", "run id", "job/1", "a" * 200])
def test_sink_id_must_be_a_plain_stable_name(bad: str) -> None:
    with pytest.raises(ValueError, match="sink_id"):
        marks_property(bad)
    assert marks_property("impressions-v1") == "beamflow.sink.impressions-v1.marks"


def test_catalog_uris() -> None:
    assert postgres_catalog_uri("postgresql://u@127.0.0.1:5/db") == "postgresql+psycopg2://u@127.0.0.1:5/db"
    pg = CatalogConfig(warehouse="/w", uri="postgresql://u@h/db")
    assert pg.catalog_uri() == "postgresql+psycopg2://u@h/db"
    assert CatalogConfig(warehouse="/w").catalog_uri() == "sqlite:////w/catalog.db"
    assert CatalogConfig(warehouse="/w").warehouse_uri() == "file:///w"
    with pytest.raises(ValueError):
        postgres_catalog_uri("mysql://x")


def test_cli_offers_both_spellings_of_audit() -> None:
    parser = argparse.ArgumentParser()
    iceberg_cli.register(parser.add_subparsers(dest="command"))
    one = parser.parse_args(["iceberg", "audit", "ns.t", "--warehouse", "/w"])
    two = parser.parse_args(["audit", "iceberg", "ns.t", "--warehouse", "/w", "--json"])
    assert one.func is two.func is iceberg_cli.run_audit
    expire = parser.parse_args(["iceberg", "expire", "ns.t", "--warehouse", "/w", "--keep", "3"])
    assert (expire.func, expire.keep) == (iceberg_cli.run_expire, 3)


def test_out_of_order_offsets_with_a_key_column_lose_nothing_and_add_nothing_twice(tmp_path: Path) -> None:
    """After a shuffle by event id a partition's offsets arrive out of order; the key, not the marks, decides."""
    import datetime as dt

    from beamflow.iceberg.catalog import CatalogConfig, open_catalog
    from beamflow.iceberg.committer import IcebergCommitter

    catalog = open_catalog(CatalogConfig.local(tmp_path))
    catalog.create_namespace("ooo")
    committer = IcebergCommitter(
        catalog,
        "ooo.t",
        "ooo-sink",
        key_column="event_id",
        key_time_column="event_time",
        partition_by=[("event_time", "day")],
    )

    def rows(offsets: list[int]) -> list[dict[str, object]]:
        return [
            {
                "event_id": f"e{o}",
                "event_time": dt.datetime(2026, 1, 1 + o % 3, tzinfo=dt.UTC),
                "_kafka": {"topic": "t", "partition": 0, "offset": o},
            }
            for o in offsets
        ]

    assert committer.commit(rows([1, 2, 5])).rows_written == 3
    later = committer.commit(rows([3, 4, 2]))  # 3 and 4 arrive after 5 was committed; 2 is a replay
    assert (later.rows_written, later.rows_existing_key) == (2, 1)
    again = committer.commit(rows([1, 1, 6, 6, 7]))
    assert (again.rows_written, again.rows_duplicate_in_batch, again.rows_existing_key) == (2, 2, 1)
    ids = catalog.load_table("ooo.t").scan().to_arrow()["event_id"].to_pylist()
    assert sorted(ids) == [f"e{i}" for i in range(1, 8)]
    assert committer.committed_marks() == {"t": {0: 7}}


@pytest.mark.parametrize("owner_setting", [None, "false"])
def test_a_long_run_of_commits_keeps_the_manifest_list_bounded(tmp_path: Path, owner_setting: str | None) -> None:
    """pyiceberg 0.8.1 fast-appends by default: a manifest per commit, a list (and pyiceberg's cache of lists) that
    grows for ever in a streaming sink. The committer turns manifest merging on unless the table's owner set it;
    two committers alternate, so each also follows the other's merged manifests (``KnownKeys``)."""
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog
    from beamflow.iceberg.committer import MANIFEST_MERGE, IcebergCommitter

    catalog = open_catalog(CatalogConfig.local(tmp_path))
    catalog.create_namespace("long")
    properties = {MANIFEST_MERGE: owner_setting} if owner_setting else None
    a, b = (
        IcebergCommitter(catalog, "long.t", f"sink-{n}", key_column="id", table_properties=properties) for n in "ab"
    )
    commits = 110  # merging starts at commit.manifest.min-count-to-merge, 100
    for i in range(commits):
        rows = [{"id": f"{i}-{j}", "_kafka": {"topic": "t", "partition": i % 2, "offset": i * 4 + j}} for j in range(4)]
        assert (a if i % 2 else b).commit(rows).rows_written == 4
    replayed = b.commit(
        [{"id": f"{commits - 1}-{j}", "_kafka": {"topic": "t", "partition": 1, "offset": j}} for j in range(4)]
    )
    assert (replayed.rows_written, replayed.rows_existing_key) == (0, 4)  # a's last rows, known to b
    table = catalog.load_table("long.t")
    ids = table.scan().to_arrow()["id"].to_pylist()
    assert len(ids) == len(set(ids)) == commits * 4
    manifests = len(table.current_snapshot().manifests(table.io))  # type: ignore[union-attr]
    if owner_setting is None:
        assert table.properties[MANIFEST_MERGE] == "true"
        assert manifests < 20
    else:  # the owner's explicit choice is kept, and this is what it costs
        assert table.properties[MANIFEST_MERGE] == "false"
        assert manifests == commits


def test_every_rows_fields_become_columns_not_just_the_first_rows() -> None:
    """``pa.Table.from_pylist`` takes its columns from the first row: a field only later rows have (a new optional
    field from the middle of a stream on) was dropped without a word. Every key of every row is a column."""
    rows = rows_to_arrow(
        [
            {"id": 1, "_kafka": {"topic": "t", "partition": 0, "offset": 1}},
            {"id": 2, "coupon": "X1", "_kafka": {"topic": "t", "partition": 0, "offset": 2}},
            {"id": 3, "topic": "u", "_kafka": None, "partition": 1, "offset": 3},
        ]
    )
    assert sorted(rows.column_names) == ["coupon", "id", "offset", "partition", "topic"]
    assert rows["coupon"].to_pylist() == [None, "X1", None]
    # A row without the sub-dict keeps its top-level coordinates; the sub-dict wins where both are given.
    assert rows["topic"].to_pylist() == ["t", "t", "u"]
    assert rows["offset"].to_pylist() == [1, 2, 3]
    assert rows.schema.field("partition").type == pa.int32()
