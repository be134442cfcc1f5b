"""The schema registry is a real Apicurio Registry: register, fetch, versions and compatibility verdicts."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
import requests

from beamflow.avro import load_schema
from beamflow.avro.registry import (
    IncompatibleSchemaError,
    SchemaNotFoundError,
    SchemaRegistryClient,
    SubjectNotFoundError,
)
from beamflow.cli import main
from beamflow.services import ServiceState

pytestmark = pytest.mark.services


def _subject() -> str:
    return f"clicks-{uuid.uuid4().hex[:8]}-value"


@pytest.fixture()
def client(registry: ServiceState) -> SchemaRegistryClient:
    return SchemaRegistryClient(registry.info["url"])


def _with_field(schema: dict[str, Any], field: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "fields": [*schema["fields"], field]}


def test_state_points_at_the_confluent_api(registry: ServiceState) -> None:
    assert registry.info["url"].endswith("/apis/ccompat/v7")
    assert requests.get(registry.info["url"] + "/subjects", timeout=5).status_code == 200


def test_register_get_by_id_and_versions(client: SchemaRegistryClient) -> None:
    subject = _subject()
    v1, v2 = load_schema("click_v1"), load_schema("click_v2")
    id1 = client.register(subject, v1)
    assert client.register(subject, v1) == id1  # idempotent
    id2 = client.register(subject, v2)
    assert id2 != id1
    assert client.get_versions(subject) == [1, 2]
    latest = client.get_latest(subject)
    assert (latest.version, latest.schema_id) == (2, id2)
    assert [f["name"] for f in latest.schema["fields"]][-2:] == ["device", "country"]
    assert client.get_version(subject, 1).schema_id == id1
    fresh = SchemaRegistryClient(client.url)  # no cache: really fetched
    assert fresh.get_schema(id1)["fields"] == v1["fields"]
    assert client.lookup(subject, v2).version == 2


def test_unknown_ids_and_subjects_are_typed(client: SchemaRegistryClient) -> None:
    with pytest.raises(SchemaNotFoundError):
        client.get_schema(987654)
    with pytest.raises(SubjectNotFoundError):
        client.get_latest(_subject())


def test_compatibility_verdicts_follow_the_subject_level(client: SchemaRegistryClient) -> None:
    subject = _subject()
    v1 = load_schema("click_v1")
    client.register(subject, v1)
    assert client.set_compatibility("BACKWARD", subject) == "BACKWARD"
    assert client.get_compatibility(subject) == "BACKWARD"

    optional = _with_field(v1, {"name": "device", "type": ["null", "string"], "default": None})
    required = _with_field(v1, {"name": "device", "type": "string"})
    retyped = {**v1, "fields": [{"name": "user_id", "type": "long"}, *v1["fields"][1:]]}

    assert client.check_compatibility(subject, optional).is_compatible
    verdict = client.check_compatibility(subject, required)
    assert not verdict.is_compatible
    assert verdict.messages  # the registry says why
    assert not client.check_compatibility(subject, retyped).is_compatible
    with pytest.raises(IncompatibleSchemaError):
        client.register(subject, required)
    assert client.get_versions(subject) == [1]


def test_cli_schema_check_verdicts(
    registry: ServiceState, postgres: ServiceState, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, subject = registry.info["url"], _subject()
    v1, v2 = load_schema("click_v1"), load_schema("click_v2")
    paths = {}
    for name, schema in {
        "v1": v1,
        "v2": v2,
        "required": _with_field(v1, {"name": "device", "type": "string"}),
    }.items():
        paths[name] = tmp_path / f"{name}.avsc"
        paths[name].write_text(json.dumps(schema))

    def check(name: str, *extra: str) -> int:
        return main(["schema", "check", "--subject", subject, "--schema", str(paths[name]), "--registry", url, *extra])

    assert check("v1") == 0  # a new subject: first version
    assert main(["schema", "register", "--subject", subject, "--schema", str(paths["v1"]), "--registry", url]) == 0
    SchemaRegistryClient(url).set_compatibility("BACKWARD", subject)

    table = f"clicks_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} (user_id TEXT, ad_id TEXT, campaign_id TEXT, event_type TEXT, "
            "event_time TIMESTAMPTZ)"
        )
    capsys.readouterr()
    assert check("v2", "--postgres-dsn", postgres.info["dsn"], "--table", table) == 0
    out = capsys.readouterr().out
    assert "SAFE to roll out" in out
    assert f"{table} gains device TEXT NULL, country TEXT NULL" in out

    assert check("required") == 1
    out = capsys.readouterr().out
    assert "INCOMPATIBLE" in out and "no default" in out and "NOT safe" in out

    # Registry says yes (level NONE) but beamflow's rule still refuses removing a field.
    SchemaRegistryClient(url).set_compatibility("NONE", subject)
    v1_minus = tmp_path / "minus.avsc"
    v1_minus.write_text(json.dumps({**v1, "fields": v1["fields"][:-1]}))
    paths["minus"] = v1_minus
    assert check("minus") == 1
    out = capsys.readouterr().out
    assert "registry (NONE): compatible" in out and "'event_time' was removed" in out
