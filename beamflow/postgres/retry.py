"""Which database errors are worth retrying, which are the data's fault, and the backoff between attempts."""

from __future__ import annotations

import logging
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psycopg
import psycopg_pool

__all__ = [
    "PostgresRefused",
    "RetryPolicy",
    "check_login",
    "error_code",
    "error_message",
    "is_data_error",
    "is_refused",
    "is_transient",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# SQLSTATE classes/codes that mean "try again": connection exceptions, operator intervention (admin shutdown,
# crash shutdown, cannot connect now), serialization failure, deadlock, insufficient resources, lock not
# available.
_TRANSIENT_PREFIXES = ("08", "57P", "53", "40001", "40P01", "55P03", "55006", "58030")
# Data exceptions and integrity violations: the rows are at fault; retrying cannot help, isolating them can.
_DATA_PREFIXES = ("22", "23", "42804", "54000")


def error_code(exc: BaseException) -> str:
    """The SQLSTATE of a server error, else the exception class name."""
    sqlstate = getattr(exc, "sqlstate", None)
    return str(sqlstate) if sqlstate else type(exc).__name__


def error_message(exc: BaseException) -> str:
    """The database's message (primary, detail, hint; without the COPY context line numbers of a batch)."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    if not primary:
        return str(exc).strip() or type(exc).__name__
    parts = [primary]
    detail = getattr(diag, "message_detail", None)
    if detail:
        parts.append(f"DETAIL: {detail}")
    column = getattr(diag, "column_name", None)
    if column and column not in primary:
        parts.append(f"COLUMN: {column}")
    return " ".join(parts)


# What the server or libpq says when the credentials or the TLS setup are wrong: retrying cannot help, and a retry
# loop would hide the cause (and look like an attack to the server).
_REFUSED = (
    "password authentication failed",
    "no password supplied",
    "pg_hba.conf rejects connection",
    "no pg_hba.conf entry",
    "certificate verify failed",
    "server does not support SSL",
)


def is_refused(exc: BaseException) -> bool:
    """The server refused who we are (wrong or missing password, no matching pg_hba.conf line, a TLS failure)."""
    sqlstate = str(getattr(exc, "sqlstate", None) or "")
    return sqlstate.startswith("28") or (
        isinstance(exc, psycopg.OperationalError) and any(text in str(exc) for text in _REFUSED)
    )


class PostgresRefused(RuntimeError):
    """PostgreSQL refused the login (credentials or TLS): one line naming the server, the user and the reason."""


def check_login(conninfo: str, connect_timeout: int = 10) -> None:
    """One connection attempt before a pool starts: a refused login raises ``PostgresRefused`` now, instead of a
    pool retrying in the background until its callers time out without the reason. Anything else (the server is
    down or restarting) is left to the pool and the retry policy."""
    try:
        psycopg.connect(conninfo, connect_timeout=connect_timeout).close()
    except psycopg.OperationalError as exc:
        if not is_refused(exc):
            return
        from psycopg.conninfo import conninfo_to_dict

        params = conninfo_to_dict(conninfo)
        where = f"{params.get('host', 'localhost')}:{params.get('port', 5432)}"
        reason = " ".join(str(exc).split()).rpartition("failed: ")[2] or type(exc).__name__
        raise PostgresRefused(
            f"PostgreSQL at {where} refused user {params.get('user', '?')!r}: {reason} (check postgres.dsn and the "
            "secret it names)"
        ) from None


def is_transient(exc: BaseException) -> bool:
    """Connection lost, server shutting down or restarting, serialization failure, deadlock, no pool slot.

    Never a refused login (``is_refused``): that fails at once, with the server's reason."""
    if is_refused(exc):
        return False
    if isinstance(exc, psycopg_pool.PoolTimeout | psycopg_pool.TooManyRequests):
        return True
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate:
        return str(sqlstate).startswith(_TRANSIENT_PREFIXES)
    # No SQLSTATE: a client-side condition. Lost or closed connections surface as
    # OperationalError/InterfaceError.
    return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)


def is_data_error(exc: BaseException) -> bool:
    """The rows are at fault: a data/integrity error from the server, or a value the client cannot encode."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate:
        return str(sqlstate).startswith(_DATA_PREFIXES)
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return False
    # Client-side adaptation: psycopg.DataError/ProgrammingError ("cannot adapt type"), or the dumpers' own
    # errors.
    return isinstance(
        exc,
        psycopg.DataError | psycopg.ProgrammingError | TypeError | ValueError | OverflowError | struct.error,
    )


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff, full jitter: attempt n sleeps uniform(0, min(max_delay, base_delay * 2**n))."""

    max_attempts: int = 12
    base_delay: float = 0.1
    max_delay: float = 5.0
    max_elapsed: float = 120.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay, self.base_delay * (2**attempt)))

    def call(self, fn: Callable[[], T], on_retry: Callable[[BaseException], None] | None = None) -> T:
        """Runs ``fn``; on a transient error sleeps and tries again; re-raises anything else, or when out of
        budget."""
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                attempt += 1
                elapsed = time.monotonic() - started
                if not is_transient(exc) or attempt >= self.max_attempts or elapsed >= self.max_elapsed:
                    raise
                pause = self.delay(attempt)
                log.warning("transient database error (attempt %d, retrying in %.2fs): %s", attempt, pause, exc)
                if on_retry is not None:
                    on_retry(exc)
                time.sleep(pause)
