"""Secrets by name: a configuration never holds a password, only where to find it, resolved where a connection opens.

A secret is written as a reference:

* ``env:NAME``: the environment variable ``NAME`` of the process that opens the connection;
* ``file:/path``: the contents of that file (one trailing newline dropped), read when the connection opens.

Where references stand: the ``password`` of a PostgreSQL DSN (``postgresql://app@db:5432/beamflow?password=env:PGPW``
or the keyword form ``host=db user=app password=file:/run/secrets/pg``), and the secret settings of a Kafka client
(``sasl.password``, ``ssl.key.password``, ... in ``kafka.consumer_config`` or ``kafka_sink.producer_config``).

Why this way: a DSN or a client config travels inside the pipeline (DoFns are pickled into the job's graph, which the
job server stores and Flink's web UI and logs may show). A reference is harmless there; the value exists only in the
worker that connects, for as long as it connects. ``postgres_conninfo`` and ``kafka_client_config`` are what every
connection site calls; ``redact_dsn`` is what anything that prints a DSN calls. ``beamflow doctor`` warns about a
password written inline.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "KAFKA_SECRET_KEYS",
    "SecretError",
    "inline_kafka_secrets",
    "inline_password",
    "is_reference",
    "kafka_client_config",
    "postgres_conninfo",
    "redact_dsn",
    "resolve_secret",
]

_PREFIXES = ("env:", "file:")
# librdkafka / Kafka client settings that hold a secret (and may be given as a reference).
KAFKA_SECRET_KEYS = (
    "sasl.password",
    "sasl.jaas.config",
    "sasl.oauthbearer.client.secret",
    "ssl.key.password",
    "ssl.keystore.password",
    "ssl.truststore.password",
    "ssl_password",  # kafka-python
    "sasl_plain_password",  # kafka-python
)


class SecretError(ValueError):
    """A secret reference that cannot be resolved; the message names the reference, never a value."""


def is_reference(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(_PREFIXES) and len(value) > len("env:")


def resolve_secret(reference: str, what: str) -> str:
    """The value ``reference`` (``env:NAME`` or ``file:/path``) names; ``what`` says whose secret it is."""
    kind, _, name = reference.partition(":")
    if kind == "env":
        value = os.environ.get(name)
        if value is None:
            raise SecretError(f"{what}: the environment variable {name} (from {reference!r}) is not set here")
        return value
    if kind == "file":
        try:
            text = Path(name).read_text()
        except OSError as exc:
            raise SecretError(f"{what}: cannot read the secret file {name}: {exc.strerror or exc}") from None
        return text[:-1] if text.endswith("\n") else text
    raise SecretError(f"{what}: {reference!r} is not a secret reference (env:NAME or file:/path)")


def _dsn_params(dsn: str) -> dict[str, Any]:
    from psycopg.conninfo import conninfo_to_dict

    try:
        return dict(conninfo_to_dict(dsn))
    except Exception as exc:  # psycopg.ProgrammingError: not a DSN at all
        raise SecretError(f"not a PostgreSQL DSN: {type(exc).__name__}") from None


def postgres_conninfo(dsn: str) -> str:
    """The DSN to connect with: a ``password`` given as ``env:``/``file:`` replaced by its value (call this where
    the connection opens, never before the DSN is pickled or logged)."""
    if "env:" not in dsn and "file:" not in dsn:
        return dsn
    params = _dsn_params(dsn)
    password = params.get("password")
    if not is_reference(password):
        return dsn
    from psycopg.conninfo import make_conninfo

    params["password"] = resolve_secret(str(password), "postgres password")
    return make_conninfo(**params)


def inline_password(dsn: str) -> bool:
    """True when the DSN carries a password itself (not a reference)."""
    try:
        password = _dsn_params(dsn).get("password")
    except SecretError:
        return False
    return bool(password) and not is_reference(password)


def redact_dsn(dsn: str) -> str:
    """The DSN for display: an inline password replaced by ``***`` (a reference is shown; it is not the secret)."""
    try:
        params = _dsn_params(dsn)
    except SecretError:
        return "<not a DSN>"
    password = params.get("password")
    if not password or is_reference(password):
        return dsn
    from psycopg.conninfo import make_conninfo

    params["password"] = "***"
    return make_conninfo(**params)


def kafka_client_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Kafka client config with every secret setting given as a reference resolved (call where the client is made)."""
    out = dict(config)
    for key, value in config.items():
        if key in KAFKA_SECRET_KEYS and is_reference(value):
            out[key] = resolve_secret(str(value), f"kafka {key}")
    return out


def inline_kafka_secrets(config: Mapping[str, Any]) -> list[str]:
    """The secret settings of a Kafka client config written inline (not as references)."""
    return [key for key, value in config.items() if key in KAFKA_SECRET_KEYS and value and not is_reference(value)]
