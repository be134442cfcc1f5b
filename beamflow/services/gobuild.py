"""Go programs Beam ships only as source (Prism, the Python SDK's ``boot``), built once from the Go module proxy.

The Go checksum database is not reachable from every sandbox this project runs in, so builds are pinned by module
version (``GOSUMDB=off``); where the checksum database is reachable, drop that to have it verified too.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from beamflow.services.base import ServiceError

__all__ = ["go_install"]


def go_install(package: str, version: str, binary_name: str, cache_dir: Path) -> Path:
    """``go install package@version`` into ``<cache>/go-bin/<last path part>/<version>/``; returns the binary.

    ``binary_name`` is what ``go install`` names it (the package's last path element).
    """
    target = cache_dir / "go-bin" / package.rsplit("/", 1)[-1] / version
    binary = target / binary_name
    if binary.exists():
        return binary
    target.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "GOBIN": str(target),
        "GOFLAGS": "-mod=mod",
        "GOSUMDB": "off",
        "GOPATH": str(cache_dir / "go"),
        "GOCACHE": str(cache_dir / "go-build"),
    }
    result = subprocess.run(
        ["go", "install", f"{package}@{version}"], env=env, capture_output=True, text=True, check=False
    )
    if result.returncode != 0 or not binary.exists():
        raise ServiceError(f"building {package}@{version} with Go failed:\n{result.stderr[-3000:]}")
    return binary
