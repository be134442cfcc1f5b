"""Every listening TCP socket and unconnected UDP socket of a set of processes, read from ``/proc`` (no tools needed):
``/proc/net/{tcp,tcp6,udp,udp6}`` joined with the socket inodes under ``/proc/<pid>/fd``. Shared by the loopback-only
test of the whole service set and the per-service port checks."""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam

__all__ = ["Bound", "SocketGate", "bound_sockets", "with_descendants"]

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp*
_UDP_UNCONNECTED = "07"  # TCP_CLOSE: a UDP socket with no peer receives from anyone


@dataclass(frozen=True)
class Bound:
    pid: int
    command: str
    proto: str
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback

    def __str__(self) -> str:
        return f"{self.proto} {self.address}:{self.port} pid {self.pid} ({self.command})"


def _decode(hex_address: str, proto: str) -> tuple[str, int]:
    address, port = hex_address.split(":")
    raw = bytes.fromhex(address)
    if proto.endswith("6"):
        # Four host-order 32-bit words.
        packed = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        ip = ipaddress.IPv6Address(packed)
        text = str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)
    else:
        text = str(ipaddress.IPv4Address(raw[::-1]))
    return text, int(port, 16)


def _bound_inodes() -> dict[str, tuple[str, str, int]]:
    """socket inode -> (proto, address, port) for every listening TCP and unconnected UDP socket on the machine."""
    found: dict[str, tuple[str, str, int]] = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        wanted = _LISTEN if proto.startswith("tcp") else _UDP_UNCONNECTED
        try:
            lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != wanted:
                continue
            address, port = _decode(fields[1], proto)
            found[fields[9]] = (proto, address, port)
    return found


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def with_descendants(roots: Iterable[int]) -> set[int]:
    tree = _children()
    seen: set[int] = set()
    todo = [pid for pid in roots if Path(f"/proc/{pid}").exists()]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(tree.get(pid, []))
    return seen


def bound_sockets(pids: Iterable[int]) -> list[Bound]:
    """Every listening TCP / unconnected UDP socket held by one of ``pids``."""
    inodes = _bound_inodes()
    result: set[Bound] = set()
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                entry = inodes.get(target[len("socket:[") : -1])
                if entry:
                    result.add(Bound(pid, command, *entry))
    return sorted(result, key=lambda b: (b.command, b.pid, b.port))


class SocketGate(beam.DoFn):
    """Holds a job in its SDK workers until the test has listed the sockets (a ``release`` file in ``folder``) or
    120 s passed; each element's worker writes ``started-<element>`` with its pid first."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def process(self, element: int) -> Iterator[int]:
        Path(self.folder, f"started-{element}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not Path(self.folder, "release").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        yield element
