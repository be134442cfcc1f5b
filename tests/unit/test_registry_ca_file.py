"""``registry.ca_file``: parsed from the config, handed to the registry client, carried by the jobs as a path.

The certificate's contents never travel in a pipeline: the DoFns hold the path and the worker reads the file when its
client connects (the TLS behaviour itself is tested against the real registry in tests/services/test_registry_tls.py).
"""

from __future__ import annotations

from pathlib import Path

import apache_beam as beam
import pytest

from beamflow.avro.registry import RegistryError, SchemaRegistryClient
from beamflow.config import ConfigError, JobConfig, RegistryConfig, load_job_config
from beamflow.services.tls import self_signed_certificate
from tests.pipeline_payloads import pickled_dofns

pytestmark = pytest.mark.unit

CONF = Path(__file__).resolve().parents[2] / "conf"
CA = "/etc/beamflow/registry-ca.pem"


def test_registry_config_parses_ca_file(tmp_path: Path) -> None:
    assert RegistryConfig().ca_file is None
    parsed = JobConfig.from_dict({"registry": {"url": "https://registry.example:8443/apis/ccompat/v7", "ca_file": CA}})
    assert parsed.registry is not None and parsed.registry.ca_file == CA
    assert JobConfig.from_dict(parsed.to_dict()).registry == parsed.registry  # round trip
    # From a file and from --set; null means the system's CAs.
    conf = tmp_path / "job.yaml"
    conf.write_text(f"registry:\n  url: https://registry.example:8443/apis/ccompat/v7\n  ca_file: {CA}\n")
    config = load_job_config(conf)
    assert config.registry is not None and config.registry.ca_file == CA
    overridden = load_job_config(conf, ["registry.ca_file=/other/ca.pem"])
    assert overridden.registry is not None and overridden.registry.ca_file == "/other/ca.pem"
    cleared = load_job_config(conf, ["registry.ca_file=null"])
    assert cleared.registry is not None and cleared.registry.ca_file is None
    with pytest.raises(ConfigError, match=r"registry\.ca_file must be a string"):
        JobConfig.from_dict({"registry": {"ca_file": ["a.pem"]}})
    with pytest.raises(ConfigError, match=r"registry\.ca_fil: unknown key; did you mean 'ca_file'\?"):
        JobConfig.from_dict({"registry": {"ca_fil": CA}})


def test_the_client_verifies_with_the_ca_file_and_names_a_missing_one(tmp_path: Path) -> None:
    cert, _ = self_signed_certificate(tmp_path, "ca")
    client = SchemaRegistryClient("https://127.0.0.1:9/apis/ccompat/v7", ca_file=str(cert))
    assert client.ca_file == str(cert) and client._session.verify == str(cert)
    assert SchemaRegistryClient("https://127.0.0.1:9").ca_file is None
    missing = SchemaRegistryClient("https://127.0.0.1:9/apis/ccompat/v7", ca_file=str(tmp_path / "nope.pem"))
    with pytest.raises(RegistryError) as raised:
        missing.get_subjects()
    message = str(raised.value)
    assert "\n" not in message and "https://127.0.0.1:9/apis/ccompat/v7" in message and "nope.pem" in message


def test_self_signed_certificate_is_made_once_with_a_private_key(tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path / "tls", "server", owner="Test")
    assert (cert.name, key.name) == ("server.crt", "server.key")
    assert cert.read_text().startswith("-----BEGIN CERTIFICATE-----")
    assert key.stat().st_mode & 0o777 == 0o600
    before = cert.read_bytes()
    assert self_signed_certificate(tmp_path / "tls", "server") == (cert, key)
    assert cert.read_bytes() == before  # not made again


@pytest.mark.parametrize("job", ["clicks", "rides"])
def test_the_jobs_decode_avro_carries_the_ca_path_not_the_certificate(job: str, tmp_path: Path) -> None:
    from pipelines import clicks, rides
    from runners.direct import local_options

    build_pipeline = {"clicks": clicks.build_pipeline, "rides": rides.build_pipeline}[job]
    cert, _ = self_signed_certificate(tmp_path / "tls", "registry")
    body = "".join(cert.read_text().splitlines()[1:-1])[:48].encode()  # a stretch of the certificate's base64
    overrides = [
        "kafka.bootstrap=127.0.0.1:9",
        "registry.url=https://127.0.0.1:9/apis/ccompat/v7",
        f"registry.ca_file={cert}",
        "postgres.dsn=postgresql://app@127.0.0.1:9/beamflow",
    ]
    if job == "clicks":
        overrides += [
            f"iceberg.catalog.uri=sqlite:///{tmp_path / 'catalog.db'}",
            f"iceberg.catalog.warehouse=file://{tmp_path / 'warehouse'}",
        ]
    config = load_job_config(CONF / f"{job}.yaml", overrides)
    pipeline = beam.Pipeline(options=local_options())
    build_pipeline(pipeline, config)
    dofns = pickled_dofns(pipeline.to_runner_api())
    decoders = [blob for blob in dofns if b"_DecodeFn" in blob]
    assert decoders, "no DecodeAvro DoFn in the job"
    assert all(str(cert).encode() in blob for blob in decoders)
    assert not [blob for blob in dofns if body in blob]
