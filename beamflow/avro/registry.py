"""A small client for the Confluent schema-registry REST API (served by Apicurio's ``/apis/ccompat/v7``).

Only what beamflow needs: register, look up, fetch by id (cached: an id's schema never changes), latest
version, versions, compatibility check against the registry's own rules, and per-subject compatibility
level. Errors are typed: a 404 for a schema id is ``SchemaNotFoundError`` (a data problem: the record
names a schema nobody registered), a refused connection is ``RegistryUnavailableError`` (an
infrastructure problem: retry, do not dead-letter).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

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


def canonical_schema(schema: dict[str, Any] | str) -> str:
    """The schema as compact JSON text (what the registry stores); a string is parsed first to validate it."""
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    return json.dumps(parsed, separators=(",", ":"))


class SchemaRegistryClient:
    """Talks to one registry at ``url`` (the Confluent-compatible base, e.g. ``http://host:port/apis/ccompat/v7``).

    Thread-safe; keeps one HTTP session. Schemas fetched by id are cached for the client's lifetime.
    """

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._session = requests.Session()
        self._session.headers.update({"Accept": _CONTENT_TYPE, "Content-Type": _CONTENT_TYPE})
        self._by_id: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    # -- plumbing --------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self._session.request(method, self.url + path, json=body, timeout=self.timeout)
        except requests.RequestException as exc:
            raise RegistryUnavailableError(f"schema registry at {self.url} unreachable: {exc}") from exc
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
