"""The registry over TLS: Apicurio's second port serves HTTPS with the certificate the service made.

A client with the registry's CA file registers and fetches schemas through ``secure_url``. The guarantee broken: a
client that cannot verify the server (system trust, another CA), or that speaks the wrong protocol to a port, gets
one ``RegistryError`` line naming the registry, at once, from one request (no retries, not an "unavailable" outage).
The HTTPS port listens on 127.0.0.1 only.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import certifi
import pytest
import requests

from beamflow.avro import load_schema
from beamflow.avro.registry import RegistryError, RegistryUnavailableError, SchemaRegistryClient
from beamflow.services import ServiceState
from beamflow.services.registry import CCOMPAT_PATH, STATE_LAYOUT, RegistryService
from beamflow.services.tls import self_signed_certificate
from tests.sockets import bound_sockets, with_descendants

pytestmark = pytest.mark.services


def _subject() -> str:
    return f"tls-{uuid.uuid4().hex[:8]}-value"


def test_register_and_fetch_through_the_https_port_with_the_ca(
    registry: ServiceState, monkeypatch: pytest.MonkeyPatch
) -> None:
    https = registry.ports["https"]
    assert https != registry.ports["http"]
    assert registry.info["secure_url"] == f"https://127.0.0.1:{https}{CCOMPAT_PATH}"
    assert Path(registry.info["ca_file"]).read_text().startswith("-----BEGIN CERTIFICATE-----")
    # requests lets REQUESTS_CA_BUNDLE override a session's CA; the client's CA must win over it.
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", certifi.where())
    secure = SchemaRegistryClient(registry.info["secure_url"], ca_file=registry.info["ca_file"])
    subject, v1 = _subject(), load_schema("click_v1")
    schema_id = secure.register(subject, v1)
    fresh = SchemaRegistryClient(registry.info["secure_url"], ca_file=registry.info["ca_file"])  # no cache
    assert fresh.get_schema(schema_id)["fields"] == v1["fields"]
    latest = fresh.get_latest(subject)
    assert (latest.version, latest.schema_id) == (1, schema_id)
    assert subject in fresh.get_subjects()
    # The same registry behind both ports; plain HTTP stays the local default.
    assert SchemaRegistryClient(registry.info["url"]).get_latest(subject).schema_id == schema_id


def _failure(client: SchemaRegistryClient) -> tuple[RegistryError, float, int]:
    """The error of one call, how long it took and how many HTTP requests the client made for it."""
    calls = 0
    request = client._session.request

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return request(*args, **kwargs)

    client._session.request = counted  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(RegistryError) as raised:
        client.get_subjects()
    return raised.value, time.monotonic() - started, calls


@pytest.mark.parametrize("case", ["system trust", "another CA", "plain http to the https port", "https to http"])
def test_a_client_that_cannot_verify_the_registry_fails_once_in_one_line(
    case: str, registry: ServiceState, tmp_path: Path
) -> None:
    secure_url, ca = registry.info["secure_url"], registry.info["ca_file"]
    if case == "system trust":
        url, ca_file, says = secure_url, None, "TLS certificate not trusted"
    elif case == "another CA":
        other, _ = self_signed_certificate(tmp_path, "other")  # the same subject and names, another key
        url, ca_file, says = secure_url, str(other), "TLS certificate not trusted"
    elif case == "plain http to the https port":
        url, ca_file, says = f"http://127.0.0.1:{registry.ports['https']}{CCOMPAT_PATH}", None, "speaks TLS"
    else:
        url, ca_file, says = f"https://127.0.0.1:{registry.ports['http']}{CCOMPAT_PATH}", ca, "plain HTTP"
    error, seconds, calls = _failure(SchemaRegistryClient(url, timeout=10, ca_file=ca_file))
    message = str(error)
    assert not isinstance(error, RegistryUnavailableError), message  # a configuration problem, not an outage
    assert "\n" not in message and message.startswith(f"schema registry at {url}: "), message
    assert says in message, message
    if ca_file:
        assert ca_file in message or case == "https to http", message
    assert calls == 1 and seconds < 15, (calls, seconds)


def test_the_https_port_listens_on_loopback_only(registry: ServiceState) -> None:
    port = registry.ports["https"]
    # The registry's own sockets (its JVM and anything it started) on that port.
    listening = [b for b in bound_sockets(with_descendants(registry.pids)) if b.port == port]
    assert listening, f"the registry holds no socket listening on the HTTPS port {port}"
    assert {b.address for b in listening} == {"127.0.0.1"}, [str(b) for b in listening]


def test_a_running_registry_without_the_https_port_is_not_ready(registry: ServiceState, tmp_path: Path) -> None:
    """State left by older code (no HTTPS port, no layout) is refused by ``ready``, so ``up()`` restarts that
    registry instead of handing it out, although its HTTP API answers."""
    service = RegistryService(tmp_path, tmp_path)
    assert service.ready(registry)
    old = ServiceState(
        name="registry",
        pids=registry.pids,
        ports={"http": registry.ports["http"]},
        info={"url": registry.info["url"], "version": registry.info["version"]},
    )
    assert requests.get(old.info["url"] + "/subjects", timeout=5).status_code == 200
    assert not service.ready(old)
    assert not service.ready(ServiceState("registry", registry.pids, dict(registry.ports), {**old.info}))
    assert registry.info["layout"] == STATE_LAYOUT
