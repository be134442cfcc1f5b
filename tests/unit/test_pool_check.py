"""The PostgreSQL pool pings a connection on checkout unless it was lent less than ``RECENTLY_LENT_S`` ago."""

from __future__ import annotations

from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from beamflow.postgres.writer import RECENTLY_LENT_S, _CheckUnlessRecent


class _Connection:
    """Stands for a pooled connection: the policy only keys on it."""


def test_a_connection_is_pinged_unless_lent_moments_ago(monkeypatch: pytest.MonkeyPatch) -> None:
    pinged: list[Any] = []
    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(pinged.append))
    now = [100.0]
    check = _CheckUnlessRecent(clock=lambda: now[0])
    first, second = _Connection(), _Connection()

    check(first)  # never lent: pinged
    assert pinged == [first]
    now[0] += RECENTLY_LENT_S / 2
    check(first)  # lent moments ago: it just worked
    check(second)  # another connection keeps its own stamp
    assert pinged == [first, second]
    now[0] += RECENTLY_LENT_S
    check(first)  # idle for a while: the server may have restarted since
    assert pinged == [first, second, first]
