"""Fetching what the services need from the registries this project may use (Maven Central, PyPI), into the cache.

Every function is idempotent: a finished download leaves a stamp file and is not repeated.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from beamflow.services.base import ServiceError

__all__ = ["FLINK_MAVEN_REPO", "maven_artifact", "maven_classpath", "pypi_download"]

# Maven 3.8 does not lock its local repository: two mvn processes writing one repository at once can leave it
# corrupt. Flink's pieces (the job server's classpath, Beam's sources) are installed beside the other services'
# (``ServiceSet.prefetch``), so they resolve into a repository of their own; the others share "m2", one at a time.
FLINK_MAVEN_REPO = "m2-flink"

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>beamflow.cache</groupId><artifactId>{artifact}</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
{dependencies}
  </dependencies>
</project>
"""


def maven_classpath(name: str, coordinates: Sequence[str], cache_dir: Path, repo: str = "m2") -> Path:
    """Resolves ``group:artifact:version`` coordinates with their runtime dependencies into ``cache_dir/jars/name``.

    ``repo``: the Maven local repository under ``cache_dir`` (see ``MAVEN_REPOS``).

    Returns the folder holding the jars (use it as ``folder/*`` on a Java classpath).
    """
    cache_dir = cache_dir.resolve()
    target = cache_dir / "jars" / name
    stamp = target / ".complete"
    if stamp.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    deps = []
    for coord in coordinates:
        group, artifact, version = coord.split(":")
        deps.append(
            f"    <dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId>"
            f"<version>{version}</version></dependency>"
        )
    pom = target / "pom.xml"
    pom.write_text(_POM.format(artifact=name, dependencies="\n".join(deps)))
    cmd = [
        "mvn",
        "-q",
        "-B",
        "-f",
        str(pom),
        f"-Dmaven.repo.local={cache_dir / repo}",
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={target}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
        raise ServiceError(f"Maven could not resolve {', '.join(coordinates)}:\n{tail}")
    stamp.write_text("\n".join(coordinates))
    return target


def maven_artifact(coordinate: str, cache_dir: Path, repo: str = "m2") -> Path:
    """One artifact without its dependencies (``group:artifact:version[:packaging[:classifier]]``, e.g. a
    ``...:jar:sources`` jar) into ``cache_dir/artifacts``; returns the file."""
    _group, artifact, version, *rest = coordinate.split(":")
    packaging = rest[0] if rest else "jar"
    classifier = rest[1] if len(rest) > 1 else ""
    target = cache_dir.resolve() / "artifacts"
    path = target / f"{artifact}-{version}{'-' + classifier if classifier else ''}.{packaging}"
    if path.exists():
        return path
    target.mkdir(parents=True, exist_ok=True)
    cmd = [
        "mvn", "-q", "-B", f"-Dmaven.repo.local={cache_dir.resolve() / repo}",
        "org.apache.maven.plugins:maven-dependency-plugin:3.6.1:copy",
        f"-Dartifact={coordinate}", f"-DoutputDirectory={target}",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=target)
    if result.returncode != 0 or not path.exists():
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
        raise ServiceError(f"Maven could not fetch {coordinate}:\n{tail}")
    return path


def pypi_download(spec: str, cache_dir: Path) -> Path:
    """Downloads one PyPI distribution (no dependencies, never installed) into ``cache_dir/pypi``; returns its path."""
    target = cache_dir / "pypi"
    target.mkdir(parents=True, exist_ok=True)
    name, _, version = spec.partition("==")
    stem = name.replace("-", "_")
    existing = [p for p in target.iterdir() if p.name.startswith(f"{stem}-{version}")]
    if existing:
        return existing[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "-q", "-d", str(target), spec]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ServiceError(f"pip could not download {spec}: {result.stderr.strip()[-2000:]}")
    found = [p for p in target.iterdir() if p.name.startswith(f"{stem}-{version}")]
    if not found:
        raise ServiceError(f"pip downloaded {spec} but no file named {stem}-{version}* is in {target}")
    return found[0]
