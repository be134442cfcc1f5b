"""A throwaway PostgreSQL cluster on 127.0.0.1, started from the Debian ``postgresql`` package's binaries.

PostgreSQL refuses to run as root, and tests and CI run as root; so when we are root the cluster is created
and run as the unprivileged ``postgres`` OS user (created if missing), with its data folder chowned to that
user. The server listens on 127.0.0.1 only, trusts local connections (it is a test cluster) and keeps its unix
socket inside its own folder, so it never collides with a system PostgreSQL.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

from beamflow.services.base import (
    LocalService,
    ServiceError,
    ServiceState,
    free_port,
    pid_alive,
    port_open,
    start_process,
    stop_process_group,
    wait_until,
)
from beamflow.services.tls import self_signed_certificate

__all__ = ["PostgresService", "find_bin_dir"]

DATABASE = "beamflow"
SUPERUSER = "postgres"
# Members of this group role log in with scram-sha-256 over TLS only (never trust, never unencrypted); ``SECURE_ROLE``
# is one, with a password generated at the first start and kept in ``<home>/secure/password`` (mode 600).
# ``info["secure_dsn"]`` refers to that file (``password=file:...``, resolved where a connection opens:
# beamflow/secrets.py) and verifies the server's certificate (self-signed, generated at setup with openssl).
SCRAM_GROUP = "beamflow_scram"
SECURE_ROLE = "beamflow_secure"
_HBA_BEGIN = "# beamflow begin: roles in beamflow_scram log in with a password, over TLS, only"
_HBA_END = "# beamflow end"
_HBA_BLOCK = f"""{_HBA_BEGIN}
hostssl  all  +{SCRAM_GROUP}  127.0.0.1/32  scram-sha-256
hostssl  all  +{SCRAM_GROUP}  ::1/128       scram-sha-256
host     all  +{SCRAM_GROUP}  all           reject
local    all  +{SCRAM_GROUP}                reject
{_HBA_END}
"""
OS_USER = "postgres"
# Unix socket paths are limited to 107 bytes; past that we run TCP only.
_MAX_SOCKET_DIR = 90


def find_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<ver>/bin`` holding initdb and postgres (Debian layout), else None."""
    candidates = []
    for path in glob.glob("/usr/lib/postgresql/*/bin"):
        bin_dir = Path(path)
        if (bin_dir / "initdb").exists() and (bin_dir / "postgres").exists():
            try:
                version = int(bin_dir.parent.name.split(".")[0])
            except ValueError:
                version = 0
            candidates.append((version, bin_dir))
    if not candidates:
        return None
    return max(candidates)[1]


class PostgresService(LocalService):
    """PostgreSQL with database ``beamflow``; ``info["dsn"]`` is
    ``postgresql://postgres@127.0.0.1:PORT/beamflow``."""

    name = "postgres"

    @property
    def cluster_dir(self) -> Path:
        return self.home / "cluster"

    @property
    def socket_dir(self) -> Path:
        return self.home / "socket"

    def install(self) -> None:
        if find_bin_dir() is None:
            if os.geteuid() != 0 or shutil.which("apt-get") is None:
                raise ServiceError(
                    "PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin; "
                    "install the 'postgresql' package (apt-get install -y postgresql)"
                )
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            for cmd in (
                ["apt-get", "update"],
                ["apt-get", "install", "-y", "--no-install-recommends", "postgresql"],
            ):
                result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if result.returncode != 0:
                    tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
                    raise ServiceError(f"{' '.join(cmd)} failed:\n{tail}")
            if find_bin_dir() is None:
                raise ServiceError("apt-get installed postgresql but no /usr/lib/postgresql/*/bin/initdb appeared")
        if os.geteuid() == 0:
            self._ensure_os_user()

    @staticmethod
    def _ensure_os_user() -> None:
        try:
            pwd.getpwnam(OS_USER)
            return
        except KeyError:
            pass
        result = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OS_USER],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise ServiceError(f"could not create OS user {OS_USER!r}: {result.stderr.strip()}")

    def _run_as(self) -> str | None:
        """The OS user to run the server as: ``postgres`` when we are root, else ourselves."""
        return OS_USER if os.geteuid() == 0 else None

    def _chown_tree(self, path: Path) -> None:
        user = self._run_as()
        if user is None:
            return
        entry = pwd.getpwnam(user)
        for root, dirs, files in os.walk(path):
            os.chown(root, entry.pw_uid, entry.pw_gid)
            for name in dirs + files:
                os.chown(os.path.join(root, name), entry.pw_uid, entry.pw_gid, follow_symlinks=False)

    def _check_traversable(self) -> None:
        """The server user must be able to reach its folder; a parent like /root (mode 700) would stop it."""
        user = self._run_as()
        if user is None:
            return
        for parent in self.home.resolve().parents:
            mode = parent.stat().st_mode
            if not mode & 0o001:
                raise ServiceError(
                    f"the {user!r} OS user cannot enter {parent} (mode {oct(mode & 0o777)}); "
                    f"put the data folder (BEAMFLOW_DATA / BEAMFLOW_TEST_DATA) somewhere world-traversable"
                )

    def _initdb(self, bin_dir: Path) -> None:
        self.cluster_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.cluster_dir, 0o700)
        self._chown_tree(self.home)
        cmd = [
            str(bin_dir / "initdb"),
            "-D",
            str(self.cluster_dir),
            "--auth=trust",
            f"--username={SUPERUSER}",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, user=self._run_as(), check=False)
        if result.returncode != 0:
            raise ServiceError(f"initdb failed:\n{(result.stdout + result.stderr)[-3000:]}")

    def _previous_port(self) -> int | None:
        """Restarting keeps the port when it is still free, so clients' DSNs stay valid across a restart."""
        previous = self.state()
        if previous and "postgres" in previous.ports:
            port = previous.ports["postgres"]
            if not port_open(port):
                return port
        return None

    def _start(self) -> ServiceState:
        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise ServiceError("PostgreSQL binaries disappeared after install()")
        self._check_traversable()
        if not (self.cluster_dir / "PG_VERSION").exists():
            shutil.rmtree(self.cluster_dir, ignore_errors=True)
            self._initdb(bin_dir)
        # A postmaster.pid left by a killed server would stop the new one from starting.
        stale_pid = self.cluster_dir / "postmaster.pid"
        if stale_pid.exists():
            stale_pid.unlink()
        socket_dir = ""
        if len(str(self.socket_dir)) <= _MAX_SOCKET_DIR:
            self.socket_dir.mkdir(parents=True, exist_ok=True)
            socket_dir = str(self.socket_dir)
        self._write_hba()
        cert, key = self._tls_files()
        password_file = self._secure_password_file()
        self._chown_tree(self.home)
        port = self._previous_port() or free_port()
        argv = [
            str(bin_dir / "postgres"),
            "-D",
            str(self.cluster_dir),
            "-p",
            str(port),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"unix_socket_directories={socket_dir}",
            "-c",
            "max_connections=100",
            # TLS for whoever asks (libpq's default sslmode=prefer does); required for the scram group (pg_hba.conf).
            "-c",
            "ssl=on",
            "-c",
            f"ssl_cert_file={cert}",
            "-c",
            f"ssl_key_file={key}",
        ]
        log_path = self.home / "postgres.log"
        proc = start_process(argv, log_path, user=self._run_as(), cwd=self.home)
        dsn = f"postgresql://{SUPERUSER}@127.0.0.1:{port}/{DATABASE}"
        admin_dsn = f"postgresql://{SUPERUSER}@127.0.0.1:{port}/postgres"
        state = ServiceState(
            name=self.name,
            pids=[proc.pid],
            ports={"postgres": port},
            info={
                "dsn": dsn,
                "admin_dsn": admin_dsn,
                # scram-sha-256 with the password read from a file when the connection opens.
                "secure_dsn": (
                    f"postgresql://{SECURE_ROLE}@127.0.0.1:{port}/{DATABASE}?password=file:{password_file}"
                    f"&sslmode=verify-full&sslrootcert={cert}"
                ),
                "secure_password_file": str(password_file),
                "tls_cert": str(cert),
                "data": str(self.cluster_dir),
                "log": str(log_path),
            },
        )

        def accepting() -> bool:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise ServiceError(f"postgres exited with code {proc.returncode}:\n{tail}")
            return _query_ok(admin_dsn)

        try:
            wait_until(accepting, 60, f"PostgreSQL on 127.0.0.1:{port}")
            self._create_database(admin_dsn)
            self._create_roles(dsn, password_file.read_text())
            wait_until(lambda: self.ready(state), 30, f"database {DATABASE!r}")
        except BaseException:
            stop_process_group(proc.pid, timeout=10)
            raise
        return state

    def _write_hba(self) -> None:
        """Password-over-TLS logins for the scram group, ahead of initdb's trust lines (the first match wins)."""
        hba = self.cluster_dir / "pg_hba.conf"
        text = hba.read_text()
        if _HBA_BEGIN in text:  # an earlier start's block: replaced by this version's
            before, _, rest = text.partition(_HBA_BEGIN)
            text = before + rest.partition(_HBA_END + "\n")[2]
        hba.write_text(_HBA_BLOCK + text.lstrip("\n"))

    @property
    def tls_dir(self) -> Path:
        return self.home / "tls"

    def _tls_files(self) -> tuple[Path, Path]:
        """The server's certificate and key (EC P-256, for 127.0.0.1 and localhost), generated once with openssl."""
        return self_signed_certificate(self.tls_dir, "server", owner="PostgreSQL")

    def _secure_password_file(self) -> Path:
        """The secure role's password: random, generated once, readable by this user only."""
        import secrets

        folder = self.home / "secure"
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        path = folder / "password"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(24))
        return path

    @staticmethod
    def _create_roles(dsn: str, password: str) -> None:
        """The scram group (may create tables in the database's public schema) and the secure role in it."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            for role, login in ((SCRAM_GROUP, False), (SECURE_ROLE, True)):
                if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                    conn.execute(
                        sql.SQL("CREATE ROLE {} " + ("LOGIN" if login else "NOLOGIN")).format(sql.Identifier(role))
                    )
            conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(SCRAM_GROUP), sql.Identifier(SECURE_ROLE)))
            conn.execute(sql.SQL("GRANT USAGE, CREATE ON SCHEMA public TO {}").format(sql.Identifier(SCRAM_GROUP)))
            # Set on every start (the server stores only its scram verifier; statements are not logged by default).
            conn.execute(
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(SECURE_ROLE), sql.Literal(password))
            )

    @staticmethod
    def _create_database(admin_dsn: str) -> None:
        import psycopg

        with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=5) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone()
            if not exists:
                conn.execute(f"CREATE DATABASE {DATABASE}")

    def ready(self, state: ServiceState) -> bool:
        return _query_ok(str(state.info["dsn"]))

    def down(self) -> None:
        """Fast shutdown (SIGINT: roll back open transactions, close clients), then the shared group stop."""
        current = self.state()
        if current is None:
            return
        for pid in current.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGINT)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and pid_alive(pid):
                time.sleep(0.1)
            # Reap it if we are its parent, so no zombie is left behind.
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        super().down()

    def restart(self) -> ServiceState:
        """Stops the server and starts it again on the same port and data (a server restart as clients see
        it)."""
        self.down()
        return self.up()


def _query_ok(dsn: str) -> bool:
    import psycopg

    with psycopg.connect(dsn, connect_timeout=3) as conn:
        row = conn.execute("SELECT 1").fetchone()
        return row == (1,)
