"""The contract every local service follows, and the process plumbing they share.

A service is a real server process (Kafka, PostgreSQL, Flink, the schema registry) that the project starts itself on
127.0.0.1. Its state (pid, ports, data folder) is written to ``<data_dir>/<name>/state.json`` so that one process can
start it (``beamflow services up``) and another can use or stop it (tests, the demo, benchmarks).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LocalService",
    "ServiceError",
    "ServiceState",
    "free_port",
    "install_lock",
    "pid_alive",
    "start_process",
    "stop_process_group",
    "wait_for_port",
    "wait_until",
]


class ServiceError(RuntimeError):
    """A service could not be installed, started, reached or stopped; the message says which and why."""


# Ports handed out by this process: two services set up in one go must not get the same one before either binds it.
_HANDED_OUT: set[int] = set()
_LOWEST_PORT = 10_000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's ephemeral range.

    Services keep their ports across restarts (a restarted TaskManager or broker comes back on the ports the others
    know). A port from the ephemeral range can be taken, while its service is down, as the local end of any outgoing
    connection (a Kafka client's, a psycopg pool's), and the restart then fails on "address already in use"; ports
    below that range are only ever bound on purpose. Falls back to a kernel-chosen port when none is found.
    """
    low, _ = _ephemeral_range()
    if low - 1 > _LOWEST_PORT:
        rng = random.Random()
        for _ in range(200):
            port = rng.randint(_LOWEST_PORT, low - 1)
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    _HANDED_OUT.add(port)
    return port


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.25) -> None:
    """Polls ``check`` until it returns True; raises ServiceError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:  # a probe failing is the normal "not yet"
            last_error = exc
        time.sleep(interval)
    raise ServiceError(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {last_error}" if last_error else ""))


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def wait_for_port(port: int, timeout: float, what: str) -> None:
    wait_until(lambda: port_open(port), timeout, f"{what} on 127.0.0.1:{port}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still "exists"; treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def start_process(
    argv: Sequence[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    user: str | None = None,
) -> subprocess.Popen[bytes]:
    """Starts a server in its own process group (so stopping it takes its children too), logging to a file."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed with it
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.Popen(
        list(argv),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=full_env,
        cwd=str(cwd) if cwd else None,
        start_new_session=True,
        user=user,
    )


def stop_process_group(pid: int, timeout: float = 30.0) -> None:
    """SIGTERM to the whole process group, then SIGKILL whatever is left after ``timeout`` seconds."""
    if not pid_alive(pid):
        return
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


@dataclass
class ServiceState:
    """What a running service left behind for other processes: its pids, ports and anything else they need."""

    name: str
    pids: list[int] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def alive(self) -> bool:
        return bool(self.pids) and all(pid_alive(p) for p in self.pids)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__, indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> ServiceState | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


_INSTALL_LOCKS: dict[str, threading.Lock] = {}
_INSTALL_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def install_lock(name: str, cache_dir: Path) -> Iterator[None]:
    """Held while a service's ``install`` runs: one installer per service and cache folder, across threads (a
    background prefetch and the service's own ``up``) and across processes (a test's subprocess running ``beamflow
    services up`` while the test session's prefetch still installs), so two never download into the same folders."""
    with _INSTALL_LOCKS_GUARD:
        in_process = _INSTALL_LOCKS.setdefault(name, threading.Lock())
    with in_process:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with open(cache_dir / f".install-{name}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            yield


class LocalService(ABC):
    """One real server on 127.0.0.1, with its data under ``data_dir/<name>``.

    Subclasses implement ``install`` (fetch what is missing into the cache, idempotent), ``_start`` (launch, wait until
    it answers, return its state) and ``ready`` (a real protocol-level check). Stopping is shared: the process groups
    recorded in the state are terminated.
    """

    name: str = "service"

    def __init__(self, data_dir: Path, cache_dir: Path) -> None:
        self.data_dir = data_dir
        self.cache_dir = cache_dir
        self.home = data_dir / self.name

    @property
    def state_path(self) -> Path:
        return self.home / "state.json"

    def state(self) -> ServiceState | None:
        return ServiceState.load(self.state_path)

    @abstractmethod
    def install(self) -> None: ...

    @abstractmethod
    def _start(self) -> ServiceState: ...

    @abstractmethod
    def ready(self, state: ServiceState) -> bool: ...

    def up(self) -> ServiceState:
        """Starts the service unless a healthy instance already runs; returns its state."""
        current = self.state()
        if current and current.alive():
            with contextlib.suppress(Exception):
                if self.ready(current):
                    return current
            self.down()
        with install_lock(self.name, self.cache_dir):
            self.install()
        self.home.mkdir(parents=True, exist_ok=True)
        state = self._start()
        state.save(self.state_path)
        return state

    def down(self) -> None:
        current = self.state()
        if current is None:
            return
        for pid in reversed(current.pids):
            stop_process_group(pid)
        current.pids = []
        current.save(self.state_path)

    def status(self) -> dict[str, Any]:
        current = self.state()
        if current is None:
            return {"name": self.name, "running": False}
        running = current.alive()
        healthy = False
        if running:
            with contextlib.suppress(Exception):
                healthy = self.ready(current)
        return {"name": self.name, "running": running, "healthy": healthy, "ports": current.ports, **current.info}
