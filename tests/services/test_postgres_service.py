"""The PostgreSQL service is a real server: connect, create, upsert, read back; it runs unprivileged and
restarts."""

from __future__ import annotations

import os

import psycopg
import pytest

from beamflow.services import ServiceSet, ServiceState

pytestmark = pytest.mark.services


def test_connect_create_upsert_read_back(postgres: ServiceState) -> None:
    dsn = postgres.info["dsn"]
    assert dsn == f"postgresql://postgres@127.0.0.1:{postgres.ports['postgres']}/beamflow"
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert conn.execute("SELECT current_database()").fetchone() == ("beamflow",)
        conn.execute("DROP TABLE IF EXISTS svc_check")
        conn.execute("CREATE TABLE svc_check (id int PRIMARY KEY, name text)")
        upsert = "INSERT INTO svc_check VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET name = excluded.name"
        conn.execute(upsert, (1, "first"))
        conn.execute(upsert, (1, "second"))
        conn.execute(upsert, (2, "other"))
        assert conn.execute("SELECT id, name FROM svc_check ORDER BY id").fetchall() == [
            (1, "second"),
            (2, "other"),
        ]
        # Listening on loopback only.
        assert conn.execute("SHOW listen_addresses").fetchone() == ("127.0.0.1",)


def test_server_runs_unprivileged_and_is_tracked(postgres: ServiceState, service_set: ServiceSet) -> None:
    # The state as it is now: drills earlier in the run restart the server (a new pid), so the fixture's first
    # state may name a pid that is gone.
    postgres = service_set.get("postgres").state() or postgres
    assert postgres.alive()
    status = service_set.get("postgres").status()
    assert status["running"] and status["healthy"]
    with open(f"/proc/{postgres.pids[0]}/status") as f:
        uid_line = next(line for line in f if line.startswith("Uid:"))
    server_uid = int(uid_line.split()[1])
    if os.geteuid() == 0:
        assert server_uid != 0, "PostgreSQL must not run as root"


def test_restart_keeps_port_and_data(postgres: ServiceState, service_set: ServiceSet) -> None:
    dsn = postgres.info["dsn"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS svc_restart")
        conn.execute("CREATE TABLE svc_restart AS SELECT 42 AS answer")
    service = service_set.get("postgres")
    old_pid = postgres.pids[0]
    restarted = service.restart()  # type: ignore[attr-defined]
    postgres.pids[:] = restarted.pids  # keep the session's state object current for later tests
    assert restarted.ports == postgres.ports
    assert restarted.info["dsn"] == dsn
    assert restarted.pids[0] != old_pid
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT answer FROM svc_restart").fetchone() == (42,)
