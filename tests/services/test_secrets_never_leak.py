"""A password given by reference (``password=file:...``) is used where connections open and appears nowhere else.

PostgreSQL's scram group (``beamflow_scram``, password logins only) makes the password matter: a role of that group
with a sentinel password runs the clicks job on the local runner, writes its dead letters, and is counted by
``beamflow status``'s sink totals; the sentinel is then searched in the dead-letter rows, ``beamflow doctor``'s
output, the status output, the messages of every failure a wrong or missing secret causes, and the job's graph.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import pipelines.clicks as clicks
from beamflow.cli.status import sink_totals
from beamflow.config import load_job_config, resolve_auto
from beamflow.generate import TrafficSpec, avro_click_encoder, generate_traffic, produce_traffic
from beamflow.kafka.admin import create_topic
from beamflow.postgres.sessions import SessionStore
from beamflow.secrets import SecretError, postgres_conninfo
from beamflow.services import ServiceSet, ServiceState
from beamflow.services.postgres import SCRAM_GROUP, SECURE_ROLE

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf" / "clicks.yaml"
SENTINEL = f"Sentinel-{uuid.uuid4().hex}-pw"


def test_the_secure_role_logs_in_with_its_password_over_verified_tls_only(postgres: ServiceState) -> None:
    secure = postgres.info["secure_dsn"]
    password = Path(postgres.info["secure_password_file"]).read_text()
    assert "password=file:" in secure and password not in secure  # the DSN names the file, not the password
    with psycopg.connect(postgres_conninfo(secure), connect_timeout=5) as conn:
        assert conn.execute("SELECT current_user").fetchone() == (SECURE_ROLE,)
        assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (True,)
        assert conn.pgconn.ssl_in_use
    # The guarantee broken: a wrong password, none, or the right one without TLS, is refused (no trust for the group).
    port = postgres.ports["postgres"]
    base = f"127.0.0.1:{port}/beamflow?sslrootcert={postgres.info['tls_cert']}"
    refused = {
        f"postgresql://{SECURE_ROLE}:wrong@{base}&sslmode=verify-full": "password authentication failed",
        f"postgresql://{SECURE_ROLE}@{base}&sslmode=verify-full": "no password supplied",
        f"postgresql://{SECURE_ROLE}:{password}@{base}&sslmode=disable": "pg_hba.conf rejects connection",
    }
    for dsn, why in refused.items():
        with pytest.raises(psycopg.OperationalError, match=why):
            psycopg.connect(dsn, connect_timeout=5)


@pytest.fixture
def sentinel_role(postgres: ServiceState, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A role of the scram group whose password is the sentinel, and a file holding it."""
    role = f"sentinel_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                sql.Identifier(role), sql.Literal(SENTINEL), sql.Identifier(SCRAM_GROUP)
            )
        )
    secret = tmp_path / "pg-password"
    secret.write_text(SENTINEL + "\n")
    yield role, secret
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _beamflow(*args: str, data: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "beamflow", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"BEAMFLOW_DATA": str(data), "PATH": "/usr/bin:/bin"},
        timeout=120,
        check=False,
    )
    return result.stdout + result.stderr


def test_a_sentinel_password_appears_nowhere(
    kafka: ServiceState,
    registry: ServiceState,
    postgres: ServiceState,
    service_set: ServiceSet,
    sentinel_role: tuple[str, Path],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    role, secret = sentinel_role
    run = uuid.uuid4().hex[:6]
    port = postgres.ports["postgres"]
    tls = f"sslmode=verify-full&sslrootcert={postgres.info['tls_cert']}"
    dsn = f"postgresql://{role}@127.0.0.1:{port}/beamflow?password=file:{secret}&{tls}"
    overrides = [
        f"kafka.topic=leak-{run}",
        f"kafka.group_id=leak-{run}",
        f"iceberg.table=beamflow.leak_{run}",
        f"postgres.sessions_table=leak_sessions_{run}",
        f"postgres.dead_letters_table=leak_dead_{run}",
        f"postgres.quarantine_table=leak_quarantine_{run}",
        f"postgres.dsn={dsn}",
    ]
    create_topic(kafka.info["bootstrap"], f"leak-{run}", 4)
    spec = TrafficSpec(events=300, users=40, bad_per_kind=2, seed=5)
    traffic = generate_traffic(spec, avro_click_encoder(registry.info["url"], "clicks-value"))
    produce_traffic(kafka.info["bootstrap"], f"leak-{run}", traffic)
    config = load_job_config(CONF, overrides).to_dict()
    config.pop("flink", None)  # the local runner's job
    config = resolve_auto(config, service_set)
    clicks.run_with_config(config)

    # The job wrote as the sentinel role (so the referenced password was used), and no row holds it.
    with psycopg.connect(postgres.info["dsn"]) as conn:
        owner = conn.execute("SELECT tableowner FROM pg_tables WHERE tablename = %s", (f"leak_dead_{run}",)).fetchone()
        rows = conn.execute(
            sql.SQL("SELECT row_to_json(t)::text FROM {} t").format(sql.Identifier(f"leak_dead_{run}"))
        ).fetchall()
    assert owner == (role,)
    assert len(rows) == traffic.counts["bad_records"] > 0
    assert not [r for (r,) in rows if SENTINEL in r]

    # beamflow status's sink totals, read with the reference: the counts, and nothing of the secret printed.
    totals = sink_totals(config)
    assert totals["dead_letters"] == len(rows)

    # doctor, on the referenced DSN and on an inline one (it warns, and does not repeat the password).
    flags = [f"--set={o}" for o in overrides]
    doctor = _beamflow("doctor", str(CONF), *flags, data=service_set.data)
    assert "iceberg-commit-per-bundle" in doctor and "inline-password" not in doctor
    inline = f"postgres.dsn=postgresql://{role}:{SENTINEL}@db.internal:5432/beamflow"
    doctor_inline = _beamflow("doctor", str(CONF), f"--set={inline}", data=service_set.data)
    assert "inline-password" in doctor_inline and "postgres.dsn" in doctor_inline

    # Failures a secret causes: each says what is wrong, none carries the secret.
    messages: list[str] = []
    wrong = tmp_path / "wrong-password"
    wrong.write_text(SENTINEL[::-1])
    for bad in (f"file:{wrong}", f"file:{tmp_path / 'missing'}", "env:BEAMFLOW_TEST_UNSET_SECRET"):
        bad_dsn = f"postgresql://{role}@127.0.0.1:{port}/beamflow?password={bad}&{tls}"
        started = time.monotonic()
        with pytest.raises((psycopg.OperationalError, SecretError)) as failure:
            SessionStore.connect(bad_dsn, f"leak_sessions_{run}").ensure_table()
        assert time.monotonic() - started < 5  # refused at once: no retry loop behind a wrong credential
        messages.append(str(failure.value))
        bad_totals = sink_totals({**config, "postgres": {**config["postgres"], "dsn": bad_dsn}})
        assert "dead_letters" not in bad_totals
    assert "password authentication failed" in messages[0]
    assert "cannot read the secret file" in messages[1] and "BEAMFLOW_TEST_UNSET_SECRET" in messages[2]
    captured = capfd.readouterr()
    searched = {"doctor": doctor, "doctor (inline)": doctor_inline, "status": captured.out + captured.err}
    searched.update({f"error {i}": m for i, m in enumerate(messages)})
    assert "postgres counts unavailable" in searched["status"]
    assert not [where for where, text in searched.items() if SENTINEL in text], searched


def test_a_wrong_password_is_one_line_naming_the_server_at_once(
    postgres: ServiceState, sentinel_role: tuple[str, Path], tmp_path: Path
) -> None:
    """The pooled sinks and lookups check the login before their pool starts: without that, a pool retries in the
    background and its callers see only timeouts, retried for minutes, with no reason."""
    from beamflow.postgres.lookups import PostgresTableLookup
    from beamflow.postgres.retry import PostgresRefused
    from beamflow.postgres.writer import open_pool

    role, _ = sentinel_role
    wrong = tmp_path / "wrong"
    wrong.write_text(SENTINEL[::-1])
    port = postgres.ports["postgres"]
    dsn = (
        f"postgresql://{role}@127.0.0.1:{port}/beamflow?password=file:{wrong}"
        f"&sslmode=verify-full&sslrootcert={postgres.info['tls_cert']}"
    )
    for opener in (lambda: open_pool(dsn), lambda: PostgresTableLookup(dsn, "drivers", "driver_id", ["x"]).__enter__()):
        started = time.monotonic()
        with pytest.raises(PostgresRefused) as failure:
            opener()
        assert time.monotonic() - started < 5
        message = str(failure.value)
        assert len(message.splitlines()) == 1 and SENTINEL not in message and SENTINEL[::-1] not in message
        assert message.startswith(f"PostgreSQL at 127.0.0.1:{port} refused user '{role}'")
        assert "password authentication failed" in message
