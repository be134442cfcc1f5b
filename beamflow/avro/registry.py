"""A small client for the Confluent schema-registry REST API (served by Apicurio's ``/apis/ccompat/v7``).

Only what beamflow needs: register, look up, fetch by id (cached: an id's schema never changes), latest
version, versions, compatibility check against the registry's own rules, and per-subject compatibility
level. Errors are typed: a 404 for a schema id is ``SchemaNotFoundError`` (a data problem: the record
names a schema nobody registered), a refused connection is ``RegistryUnavailableError`` (an
infrastructure problem: retry, do not dead-letter).

TLS: an ``https://`` registry is verified against ``ca_file`` when one is given (else the system's CAs). A TLS
failure (a certificate that does not verify, TLS spoken to a plain HTTP port, plain HTTP to a TLS port) is a
``RegistryError`` in one line naming the registry: a configuration problem, not an outage, so it is raised at
once and never treated as transient.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import requests

__all__ = [
    "COMPATIBILITY_LEVELS",
    "CompatibilityResult",
    "IncompatibleSchemaError",
    "RegisteredSchema",
    "RegistryError",
    "RegistryUnavailableError",
    "SchemaNotFoundError",
    "SchemaRegistryClient",
    "SubjectNotFoundError",
    "canonical_schema",
]

COMPATIBILITY_LEVELS = (
    "NONE",
    "BACKWARD",
    "BACKWARD_TRANSITIVE",
    "FORWARD",
    "FORWARD_TRANSITIVE",
    "FULL",
    "FULL_TRANSITIVE",
)
_CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
_E = TypeVar("_E", bound=BaseException)


class RegistryError(RuntimeError):
    """The registry answered with an error. ``status`` is the HTTP status, ``error_code`` Confluent's code."""

    def __init__(self, message: str, status: int | None = None, error_code: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_code = error_code


class RegistryUnavailableError(RegistryError):
    """The registry could not be reached (refused, timed out, 5xx): transient, not a property of the data."""


class SubjectNotFoundError(RegistryError):
    pass


class SchemaNotFoundError(RegistryError):
    pass


class IncompatibleSchemaError(RegistryError):
    """Registering was refused because the schema breaks the subject's compatibility rule."""


@dataclass(frozen=True)
class RegisteredSchema:
    subject: str
    version: int
    schema_id: int
    schema: dict[str, Any]


@dataclass(frozen=True)
class CompatibilityResult:
    is_compatible: bool
    messages: tuple[str, ...] = ()


def _innermost(exc: BaseException, kind: type[_E]) -> _E | None:
    """The deepest exception of ``kind`` among ``exc``'s causes and arguments (requests wraps urllib3 wraps ssl)."""
    found: _E | None = None
    seen: set[int] = set()
    level: list[BaseException] = [exc]
    while level:  # breadth first: the last one found is on the deepest level
        below: list[BaseException] = []
        for current in level:
            if id(current) in seen:
                continue
            seen.add(id(current))
            if isinstance(current, kind):
                found = current
            nested = (current.__cause__, current.__context__, getattr(current, "reason", None), *current.args)
            below.extend(e for e in nested if isinstance(e, BaseException))
        level = below
    return found


def _speaks_tls(url: str, timeout: float) -> bool:
    """Whether ``url``'s host and port complete a TLS handshake (the certificate is not checked: only asked)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=min(timeout, 5.0)) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except (OSError, ValueError):
        return False


def canonical_schema(schema: dict[str, Any] | str) -> str:
    """The schema as compact JSON text (what the registry stores); a string is parsed first to validate it."""
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    return json.dumps(parsed, separators=(",", ":"))


class SchemaRegistryClient:
    """Talks to one registry at ``url`` (the Confluent-compatible base, e.g. ``http://host:port/apis/ccompat/v7``).

    ``ca_file``: a PEM file of the CA certificates an ``https://`` registry is verified with (None: the system's).
    Thread-safe; keeps one HTTP session. Schemas fetched by id are cached for the client's lifetime.
    """

    def __init__(self, url: str, timeout: float = 10.0, ca_file: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.ca_file = ca_file
        self._session = requests.Session()
        if ca_file is not None:
            self._session.verify = ca_file  # the CA (or the server's own self-signed certificate) to verify with
        self._session.headers.update({"Accept": _CONTENT_TYPE, "Content-Type": _CONTENT_TYPE})
        self._by_id: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    # -- plumbing --------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            # ``verify`` again per request: requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE override a session's
            # ``verify`` (psf/requests#3829, #4726) but not a request's. None: the session's (or the environment's).
            response = self._session.request(
                method, self.url + path, json=body, timeout=self.timeout, verify=self.ca_file
            )
        except requests.RequestException as exc:
            tls = self._tls_failure(exc)
            if tls is not None:
                raise RegistryError(f"schema registry at {self.url}: {tls}") from exc
            raise RegistryUnavailableError(f"schema registry at {self.url} unreachable: {exc}") from exc
        except OSError as exc:  # not from the network: requests refusing the CA file itself (e.g. a missing path)
            raise RegistryError(f"schema registry at {self.url}: {exc}") from exc
        if response.status_code < 300:
            return response.json()
        try:
            payload = response.json()
            message = str(payload.get("message", payload))
            code = payload.get("error_code")
        except ValueError:
            message, code = response.text.strip()[:500], None
        text = f"{method} {path}: HTTP {response.status_code}: {message}"
        if response.status_code == 404:
            if code == 40403 or path.startswith("/schemas/ids/"):
                raise SchemaNotFoundError(text, 404, code)
            raise SubjectNotFoundError(text, 404, code)
        if response.status_code == 409:
            raise IncompatibleSchemaError(text, 409, code)
        if response.status_code >= 500:
            raise RegistryUnavailableError(text, response.status_code, code)
        raise RegistryError(text, response.status_code, code)

    def _tls_failure(self, exc: requests.RequestException) -> str | None:
        """Why the request failed at the TLS layer, in one line, or None when it is not a TLS failure."""
        if isinstance(exc, requests.exceptions.SSLError):
            cause = _innermost(exc, ssl.SSLError)
            if isinstance(cause, ssl.SSLCertVerificationError):
                where = f"the CA file {self.ca_file}" if self.ca_file else "the system's CAs (no ca_file given)"
                return f"TLS certificate not trusted ({cause.verify_message}) with {where}"
            if isinstance(cause, ssl.SSLError) and cause.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE"):
                return "TLS handshake got no TLS answer: the port serves plain HTTP (use http://)"
            reason = (cause.reason or str(cause)) if isinstance(cause, ssl.SSLError) else type(exc).__name__
            return f"TLS failed ({reason})"
        # Dropped without an HTTP answer: a TLS port does that to plain HTTP. One TLS handshake (nothing sent after
        # it) tells that apart from a server going away.
        dropped = any(_innermost(exc, kind) for kind in (ConnectionResetError, http.client.BadStatusLine))
        if dropped and urlsplit(self.url).scheme == "http" and _speaks_tls(self.url, self.timeout):
            return "the port speaks TLS and was sent plain HTTP (use https:// and the registry's ca_file)"
        return None

    @staticmethod
    def _subject(subject: str) -> str:
        return quote(subject, safe="")

    # -- schemas ---------------------------------------------------------------------------------------------

    def register(self, subject: str, schema: dict[str, Any] | str) -> int:
        """Registers ``schema`` under ``subject`` (idempotent: the same schema returns the same id)."""
        text = canonical_schema(schema)
        result = self._request("POST", f"/subjects/{self._subject(subject)}/versions", {"schema": text})
        schema_id = int(result["id"])
        with self._lock:
            self._by_id.setdefault(schema_id, json.loads(text))
        return schema_id

    def lookup(self, subject: str, schema: dict[str, Any] | str) -> RegisteredSchema:
        """The registered version of exactly this schema under ``subject``; raises if it is not registered."""
        text = canonical_schema(schema)
        result = self._request("POST", f"/subjects/{self._subject(subject)}", {"schema": text})
        return RegisteredSchema(subject, int(result["version"]), int(result["id"]), json.loads(result["schema"]))

    def get_schema(self, schema_id: int) -> dict[str, Any]:
        """The schema with this id (cached). Raises ``SchemaNotFoundError`` if the registry has no such id."""
        with self._lock:
            cached = self._by_id.get(schema_id)
        if cached is not None:
            return cached
        result = self._request("GET", f"/schemas/ids/{int(schema_id)}")
        parsed: dict[str, Any] = json.loads(result["schema"])
        with self._lock:
            self._by_id[schema_id] = parsed
        return parsed

    def get_version(self, subject: str, version: int | str = "latest") -> RegisteredSchema:
        result = self._request("GET", f"/subjects/{self._subject(subject)}/versions/{version}")
        return RegisteredSchema(
            subject=result.get("subject", subject),
            version=int(result["version"]),
            schema_id=int(result["id"]),
            schema=json.loads(result["schema"]),
        )

    def get_latest(self, subject: str) -> RegisteredSchema:
        return self.get_version(subject, "latest")

    def get_versions(self, subject: str) -> list[int]:
        return [int(v) for v in self._request("GET", f"/subjects/{self._subject(subject)}/versions")]

    def get_subjects(self) -> list[str]:
        return [str(s) for s in self._request("GET", "/subjects")]

    # -- compatibility ---------------------------------------------------------------------------------------

    def check_compatibility(
        self, subject: str, schema: dict[str, Any] | str, version: int | str = "latest"
    ) -> CompatibilityResult:
        """Asks the registry whether ``schema`` may follow ``version`` of ``subject`` under its rule."""
        path = f"/compatibility/subjects/{self._subject(subject)}/versions/{version}?verbose=true"
        result = self._request("POST", path, {"schema": canonical_schema(schema)})
        messages: list[str] = []
        # Confluent answers with a "messages" list, Apicurio with a single "reason".
        for key in ("messages", "reason"):
            value = result.get(key)
            if isinstance(value, list):
                messages.extend(str(v) for v in value)
            elif value:
                messages.append(str(value))
        return CompatibilityResult(bool(result["is_compatible"]), tuple(messages))

    def set_compatibility(self, level: str, subject: str | None = None) -> str:
        """Sets the compatibility level of ``subject`` (or the global default when ``subject`` is None)."""
        level = level.upper()
        if level not in COMPATIBILITY_LEVELS:
            known = ", ".join(COMPATIBILITY_LEVELS)
            raise ValueError(f"unknown compatibility level {level!r}; one of {known}")
        path = "/config" if subject is None else f"/config/{self._subject(subject)}"
        result = self._request("PUT", path, {"compatibility": level})
        return str(result.get("compatibility", level))

    def get_compatibility(self, subject: str | None = None) -> str:
        """The subject's level; a subject without its own level falls back to the global one."""
        if subject is not None:
            try:
                result = self._request("GET", f"/config/{self._subject(subject)}")
                return str(result.get("compatibilityLevel") or result.get("compatibility"))
            except (SubjectNotFoundError, SchemaNotFoundError):
                pass
        result = self._request("GET", "/config")
        return str(result.get("compatibilityLevel") or result.get("compatibility"))

    def close(self) -> None:
        self._session.close()
