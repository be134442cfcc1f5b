"""Service ports come from below the kernel's ephemeral range, so a restarted service finds its port free."""

from __future__ import annotations

import socket

from beamflow.services.base import _ephemeral_range, free_port


def test_service_ports_are_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(p < low for p in ports), [p for p in ports if p >= low]
    with socket.socket() as sock:  # each one can be bound
        sock.bind(("127.0.0.1", ports[0]))
