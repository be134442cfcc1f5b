"""Secret references (``env:NAME``, ``file:/path``): resolved only where a connection opens, never shown."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from beamflow.config import load_job_config
from beamflow.doctor import check_config
from beamflow.secrets import (
    SecretError,
    inline_kafka_secrets,
    kafka_client_config,
    postgres_conninfo,
    redact_dsn,
    resolve_secret,
)
from beamflow.secrets import inline_password as dsn_has_password
from tests.pipeline_payloads import pickled_dofns

pytestmark = pytest.mark.unit

SENTINEL = "Sentinel-5f1c9e-never-print-me"
CONF = Path(__file__).resolve().parents[2] / "conf" / "clicks.yaml"


def test_references_resolve_from_the_environment_and_from_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BEAMFLOW_TEST_SECRET", SENTINEL)
    secret_file = tmp_path / "pw"
    secret_file.write_text(SENTINEL + "\n")
    assert resolve_secret("env:BEAMFLOW_TEST_SECRET", "x") == SENTINEL
    assert resolve_secret(f"file:{secret_file}", "x") == SENTINEL  # one trailing newline dropped
    dsn = f"postgresql://app@127.0.0.1:5432/beamflow?password=file:{secret_file}&sslmode=require"
    resolved = postgres_conninfo(dsn)
    assert f"password={SENTINEL}" in resolved and "sslmode=require" in resolved
    assert SENTINEL not in dsn  # what the pipeline carries
    assert postgres_conninfo("postgresql://app@127.0.0.1/beamflow") == "postgresql://app@127.0.0.1/beamflow"
    client = kafka_client_config({"sasl.password": "env:BEAMFLOW_TEST_SECRET", "ssl.ca.location": "file:/ca"})
    assert client == {"sasl.password": SENTINEL, "ssl.ca.location": "file:/ca"}  # only secret keys are references


def test_an_unresolvable_reference_names_itself_and_no_value(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("BEAMFLOW_TEST_MISSING", raising=False)
    with pytest.raises(SecretError, match=r"BEAMFLOW_TEST_MISSING.*not set"):
        postgres_conninfo("postgresql://app@db/beamflow?password=env:BEAMFLOW_TEST_MISSING")
    with pytest.raises(SecretError, match="cannot read the secret file"):
        resolve_secret(f"file:{tmp_path / 'absent'}", "postgres password")


def test_redaction_and_the_inline_checks() -> None:
    inline = f"postgresql://app:{SENTINEL}@db.internal:5432/beamflow"
    assert SENTINEL not in redact_dsn(inline) and "***" in redact_dsn(inline)
    assert dsn_has_password(inline) and dsn_has_password(f"host=db user=app password={SENTINEL}")
    assert not dsn_has_password("postgresql://app@db/beamflow?password=env:PGPASSWORD")
    assert not dsn_has_password("postgresql://app@db/beamflow")
    assert redact_dsn("not a dsn at all") == "<not a DSN>"
    assert inline_kafka_secrets({"sasl.password": SENTINEL, "sasl.username": "app"}) == ["sasl.password"]
    assert inline_kafka_secrets({"sasl.password": "file:/run/secrets/kafka"}) == []


def _findings(overrides: list[str]) -> set[str]:
    return {f.code for f in check_config(load_job_config(CONF, overrides))}


def test_doctor_finds_every_inline_secret_and_plaintext_only_off_this_machine() -> None:
    for speak in (
        [f"iceberg.catalog.uri=postgresql+psycopg2://app:{SENTINEL}@db/catalog"],
        [f"kafka.consumer_config={{sasl.password: {SENTINEL}}}"],
        ["kafka_sink.topic=out", f"kafka_sink.producer_config={{sasl.password: {SENTINEL}}}"],
    ):
        assert "inline-password" in _findings(speak), speak
    assert "plaintext-kafka" not in _findings(["kafka.bootstrap=127.0.0.1:9092,localhost:9093"])
    assert "plaintext-kafka" in _findings(["kafka.bootstrap=127.0.0.1:9092,10.0.0.7:9092"])
    assert "plaintext-kafka" in _findings(["kafka.bootstrap=kafka.internal:9092", "kafka_sink.topic=out"])
    assert "plaintext-kafka" in _findings(
        ["kafka.bootstrap=127.0.0.1:9092", "kafka_sink.topic=out", "kafka_sink.bootstrap=kafka.internal:9092"]
    )
    # The finding names where the password is, never the password.
    texts = [
        f"{f.message} {f.why} {f.fix}"
        for f in check_config(load_job_config(CONF, [f"postgres.dsn=postgresql://app:{SENTINEL}@db/beamflow"]))
    ]
    assert texts and not any(SENTINEL in t for t in texts)


def test_the_dofns_of_the_clicks_job_carry_the_reference_not_the_secret(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Build the clicks job with a referenced password: the pipeline's proto (pickled DoFns, options) has the
    reference only; the value it names is in this process's environment the whole time."""
    import apache_beam as beam

    monkeypatch.setenv("BEAMFLOW_TEST_PG_PASSWORD", SENTINEL)
    from pipelines.clicks import build_pipeline
    from runners.direct import local_options

    config = load_job_config(
        CONF,
        [
            "kafka.bootstrap=127.0.0.1:9",
            "registry.url=http://127.0.0.1:9/apis/ccompat/v7",
            "postgres.dsn=postgresql://app@127.0.0.1:9/beamflow?password=env:BEAMFLOW_TEST_PG_PASSWORD",
            f"iceberg.catalog.uri=sqlite:///{tmp_path / 'catalog.db'}",
            f"iceberg.catalog.warehouse=file://{tmp_path / 'warehouse'}",
            "kafka.consumer_config={sasl.password: 'env:BEAMFLOW_TEST_PG_PASSWORD'}",
        ],
    )
    pipeline = beam.Pipeline(options=local_options())
    build_pipeline(pipeline, config)
    proto = pipeline.to_runner_api()
    carried = [proto.SerializeToString(), *pickled_dofns(proto)]
    assert any(b"env:BEAMFLOW_TEST_PG_PASSWORD" in blob for blob in carried)  # the DoFns are really searched
    assert not [blob for blob in carried if SENTINEL.encode() in blob]
    assert SENTINEL.encode() not in pickle.dumps(config)
