"""beamflow's rollout rules and the Avro-to-column mapping the sinks use."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from beamflow.avro import load_schema
from beamflow.avro.evolution import (
    UnsupportedTypeError,
    avro_type_to_column,
    classify_change,
    columns_to_add,
    record_columns,
)

pytestmark = pytest.mark.unit

V1 = load_schema("click_v1")
V2 = load_schema("click_v2")


def _fields(schema: dict[str, Any], fields: list[dict[str, Any]]) -> dict[str, Any]:
    return {**schema, "fields": fields}


def test_click_v1_to_v2_is_safe() -> None:
    report = classify_change(V1, V2)
    assert report.safe
    assert report.added_fields == ("device", "country")
    assert "safe to roll out" in report.summary()


def test_identical_and_doc_only_changes_are_no_changes() -> None:
    assert classify_change(V1, V1).changes == ()
    documented = _fields(V1, [{**V1["fields"][0], "doc": "who"}, *V1["fields"][1:]])
    assert classify_change(V1, documented).changes == ()


def test_removed_field_is_refused() -> None:
    report = classify_change(V2, _fields(V2, V2["fields"][:-1]))
    assert not report.safe
    assert [(c.kind, c.field) for c in report.refused] == [("removed", "country")]
    assert "was removed" in report.refused[0].message


def test_renamed_field_is_refused_with_and_without_alias() -> None:
    renamed = [{"name": "uid", "type": "string"}, *V1["fields"][1:]]
    aliased = [{"name": "uid", "type": "string", "aliases": ["user_id"]}, *V1["fields"][1:]]
    for fields in (renamed, aliased):
        report = classify_change(V1, _fields(V1, fields))
        assert [(c.kind, c.field) for c in report.refused] == [("renamed", "uid")]
        assert "'user_id' was renamed to 'uid'" in report.refused[0].message


def test_new_required_field_is_refused() -> None:
    report = classify_change(V1, _fields(V1, [*V1["fields"], {"name": "device", "type": "string"}]))
    assert [(c.kind, c.field) for c in report.refused] == [("added_required", "device")]
    assert "no default" in report.refused[0].message


def test_type_changes_are_refused_including_promotions_and_nullability() -> None:
    for new_type in ("long", ["null", "string"], "bytes"):
        fields = [{"name": "user_id", "type": new_type}, *V1["fields"][1:]]
        report = classify_change(V1, _fields(V1, fields))
        assert [(c.kind, c.field) for c in report.refused] == [("type_changed", "user_id")], new_type


def test_record_rename_is_refused() -> None:
    report = classify_change(V1, {**V1, "name": "Click"})
    assert [c.kind for c in report.refused] == ["record_renamed"]


def test_mixed_change_lists_every_reason() -> None:
    fields = [*V2["fields"][:-1], {"name": "score", "type": "double"}]  # country removed, score added
    report = classify_change(V2, _fields(V2, fields))
    assert not report.safe
    # Different types, so not a rename: both problems are reported.
    assert sorted((c.kind, c.field) for c in report.refused) == [
        ("added_required", "score"),
        ("removed", "country"),
    ]


def test_non_record_schema_is_an_error() -> None:
    with pytest.raises(ValueError, match="record"):
        classify_change({"type": "string"}, V1)


def test_click_columns() -> None:
    columns = {c.name: c for c in record_columns(V2)}
    assert columns["user_id"].sql_type == "TEXT" and not columns["user_id"].nullable
    assert columns["event_type"].arrow_type == pa.string()
    assert columns["event_time"].sql_type == "TIMESTAMPTZ"
    assert columns["event_time"].arrow_type == pa.timestamp("us", tz="UTC")
    assert columns["device"].nullable and columns["device"].sql_type == "TEXT"


@pytest.mark.parametrize(
    ("avro_type", "arrow_type", "sql_type", "nullable"),
    [
        ("boolean", pa.bool_(), "BOOLEAN", False),
        ("int", pa.int32(), "INTEGER", False),
        (["null", "long"], pa.int64(), "BIGINT", True),
        ("float", pa.float32(), "REAL", False),
        ("double", pa.float64(), "DOUBLE PRECISION", False),
        ("bytes", pa.binary(), "BYTEA", False),
        ({"type": "int", "logicalType": "date"}, pa.date32(), "DATE", False),
        (
            {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2},
            pa.decimal128(10, 2),
            "NUMERIC(10,2)",
            False,
        ),
        ({"type": "fixed", "name": "F", "size": 4}, pa.binary(4), "BYTEA", False),
    ],
)
def test_type_mapping(avro_type: Any, arrow_type: pa.DataType, sql_type: str, nullable: bool) -> None:
    column = avro_type_to_column("f", avro_type)
    assert (column.arrow_type, column.sql_type, column.nullable) == (arrow_type, sql_type, nullable)
    assert column.arrow_field().nullable is nullable


@pytest.mark.parametrize(
    "avro_type",
    [["null", "string", "long"], {"type": "array", "items": "string"}, {"type": "map", "values": "long"}],
)
def test_unsupported_types_say_why(avro_type: Any) -> None:
    with pytest.raises(UnsupportedTypeError, match="field 'f'"):
        avro_type_to_column("f", avro_type)


def test_columns_to_add_are_the_missing_ones_all_nullable() -> None:
    existing = ["USER_ID", "ad_id", "campaign_id", "event_type", "event_time"]
    added = columns_to_add(V2, existing)
    assert [c.name for c in added] == ["device", "country"]
    assert all(c.nullable for c in added)
    assert columns_to_add(V1, existing) == []
    # A brand-new non-null field still becomes a nullable column: rows already there have no value.
    strict = _fields(V1, [*V1["fields"], {"name": "n", "type": "long", "default": 0}])
    assert [(c.name, c.nullable) for c in columns_to_add(strict, existing)] == [("n", True)]
