"""Go programs Beam ships only as source (Prism, the Python SDK's ``boot``), built once from the Go module proxy.

The Go checksum database is not reachable from every sandbox this project runs in, so builds are pinned by module
version (``GOSUMDB=off``); where the checksum database is reachable, drop that to have it verified too.

``go_install`` builds a package as published; ``go_build_patched`` builds one from a copy of its module with exact
source replacements (each must match once, else one error line), cached by a hash of version and replacements. Both
run with ``go_env``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from beamflow.services.base import ServiceError

__all__ = ["SourcePatch", "go_build_patched", "go_env", "go_install", "module_source", "patched_text"]


def go_env(cache_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of every Go command here: modules from ``GOPROXY`` (inherited) pinned by version, the module
    and build caches under ``cache_dir``; ``extra`` adds variables (``GOBIN``)."""
    return {
        **os.environ,
        "GOFLAGS": "-mod=mod",
        "GOSUMDB": "off",
        "GOPATH": str(cache_dir / "go"),
        "GOCACHE": str(cache_dir / "go-build"),
        **extra,
    }


def go_install(package: str, version: str, binary_name: str, cache_dir: Path) -> Path:
    """``go install package@version`` into ``<cache>/go-bin/<last path part>/<version>/``; returns the binary.

    ``binary_name`` is what ``go install`` names it (the package's last path element).
    """
    target = cache_dir / "go-bin" / package.rsplit("/", 1)[-1] / version
    binary = target / binary_name
    if binary.exists():
        return binary
    target.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["go", "install", f"{package}@{version}"],
        env=go_env(cache_dir, GOBIN=str(target)),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0 or not binary.exists():
        raise ServiceError(f"building {package}@{version} with Go failed:\n{result.stderr[-3000:]}")
    return binary


@dataclass(frozen=True)
class SourcePatch:
    """Replace ``old`` by ``new`` in ``file`` (relative to the module root); ``old`` must occur exactly once."""

    file: str
    old: str
    new: str


def module_source(module: str, version: str, cache_dir: Path) -> Path:
    """The module's source folder in the module cache (``go mod download``; read-only files)."""
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        env=go_env(cache_dir),
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        folder = Path(json.loads(result.stdout)["Dir"])
    except (ValueError, KeyError):
        raise ServiceError(
            f"downloading {module}@{version} with Go failed:\n{(result.stderr or result.stdout)[-3000:]}"
        ) from None
    return folder


def patched_text(source: Path, patch: SourcePatch, module: str, version: str) -> str:
    """``patch.file`` of the module at ``source`` with the patch applied; one-line ``ServiceError`` unless ``old``
    occurs exactly once (a new version must not build unpatched)."""
    path = source / patch.file
    text = path.read_text() if path.is_file() else ""
    found = text.count(patch.old)
    if found != 1:
        raise ServiceError(
            f"{module}@{version}: patch site {patch.old!r} found {found} times in {patch.file} (expected exactly "
            "once); review the patch for this version"
        )
    return text.replace(patch.old, patch.new)


def go_build_patched(
    module: str,
    version: str,
    package: str,
    binary_name: str,
    patches: Sequence[SourcePatch],
    cache_dir: Path,
    verify: Callable[[Path], None] | None = None,
) -> Path:
    """``go build ./package`` from a writable copy of ``module@version`` with ``patches`` applied, into
    ``<cache>/go-bin/<binary_name>/<version>-patched-<hash of version and patches>/``; built once, returns the binary.

    ``verify(copy)`` runs on the patched copy before the build (raise to refuse it).
    """
    key = hashlib.sha256(
        json.dumps([module, version, package, [[p.file, p.old, p.new] for p in patches]]).encode()
    ).hexdigest()[:16]
    target = cache_dir / "go-bin" / binary_name / f"{version}-patched-{key}"
    binary = target / binary_name
    if binary.exists():
        return binary
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same binary: wait for it
        if binary.exists():
            return binary
        source = module_source(module, version, cache_dir)
        for patch in patches:  # every site checked on the pristine source before anything is copied
            patched_text(source, patch, module, version)
        work = cache_dir / "go-src" / f"{binary_name}-{version}-{key}"
        _remove(work)
        shutil.copytree(source, work, copy_function=shutil.copyfile, symlinks=True)
        _make_writable(work)
        try:
            for patch in patches:  # applied in order; several patches may touch one file
                (work / patch.file).write_text(patched_text(work, patch, module, version))
            if verify is not None:
                verify(work)
            partial = target / f".{binary_name}.{os.getpid()}"
            result = subprocess.run(
                ["go", "build", "-buildvcs=false", "-o", str(partial), f"./{package}"],
                cwd=work,
                env=go_env(cache_dir),
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0 or not partial.exists():
                raise ServiceError(f"building patched {module}@{version} ./{package} failed:\n{result.stderr[-3000:]}")
            partial.replace(binary)
        finally:
            _remove(work)
    return binary


def _make_writable(tree: Path) -> None:
    for folder, dirs, files in os.walk(tree):
        for name in [*dirs, *files]:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode | stat.S_IWUSR)
    os.chmod(tree, os.stat(tree).st_mode | stat.S_IWUSR)


def _remove(tree: Path) -> None:
    if tree.exists():
        _make_writable(tree)
        shutil.rmtree(tree)
