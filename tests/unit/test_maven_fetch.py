"""The Maven every build here runs (``beamflow.services.fetch.mvn``): fetched from Maven Central, checked against its
pinned SHA-512, installed whole or not at all. Downloads about 9 MB from Maven Central, as a fresh machine does."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from beamflow.services import fetch
from beamflow.services.base import ServiceError


def test_maven_is_fetched_once_and_runs_with_the_parallel_resolver(tmp_path: Path) -> None:
    command = fetch.mvn(tmp_path)
    assert command[0] == str(tmp_path / "maven" / f"apache-maven-{fetch.MAVEN_VERSION}" / "bin" / "mvn")
    assert "-Daether.dependencyCollector.impl=bf" in command
    version = subprocess.run([command[0], "-v"], capture_output=True, text=True, check=True).stdout
    assert f"Apache Maven {fetch.MAVEN_VERSION}" in version
    assert fetch.mvn(tmp_path) == command  # the second call finds it installed


def test_an_archive_with_another_digest_is_refused_and_nothing_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "_MAVEN_SHA512", "0" * 128)
    with pytest.raises(ServiceError, match="SHA-512"):
        fetch.mvn(tmp_path)
    assert [p.name for p in (tmp_path / "maven").iterdir() if not p.name.startswith(".")] == []
