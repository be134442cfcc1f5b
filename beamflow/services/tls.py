"""Self-signed TLS certificates for the local services, made once with ``openssl`` (Debian's openssl package).

One certificate per service, for 127.0.0.1 and localhost: the certificate is also the clients' CA file (a client
that trusts it verifies the server's name and key; nothing else signs for 127.0.0.1 here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from beamflow.services.base import ServiceError

__all__ = ["self_signed_certificate"]


def self_signed_certificate(folder: Path, name: str, owner: str = "the service") -> tuple[Path, Path]:
    """``(cert, key)``: ``<folder>/<name>.crt`` and ``<folder>/<name>.key``, an EC P-256 self-signed certificate for
    IP 127.0.0.1 and DNS localhost, valid ten years, the key unencrypted with mode 600. Made at the first call; an
    existing pair is returned as it is. ``owner`` names the service in error messages."""
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    if cert.exists() and key.exists():
        return cert, key
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ServiceError(f"{owner}'s TLS certificate is made with `openssl` (Debian's openssl package)")
    folder.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "3650", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise ServiceError(f"openssl could not make {owner}'s certificate: {result.stderr.strip()[-500:]}")
    os.chmod(key, 0o600)  # servers such as PostgreSQL refuse a key others can read
    return cert, key
