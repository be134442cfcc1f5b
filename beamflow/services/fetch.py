"""Fetching what the services need from the registries this project may use (Maven Central, PyPI), into the cache.

Every function is idempotent: a finished download leaves a stamp file and is not repeated.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from beamflow.services.base import ServiceError, install_lock

__all__ = ["FLINK_MAVEN_REPO", "MAVEN_VERSION", "maven_artifact", "maven_classpath", "mvn", "pypi_download"]

# Every Maven build here runs this Maven, fetched from Maven Central, not the system's (Debian's 3.8). Maven 3.9's
# resolver collects a dependency graph breadth first with parallel POM downloads (``bf``) and fetches artifacts in
# parallel; 3.8 fetches the POMs one at a time, and the graphs here hold over a thousand. Measured from empty
# repositories on a 2-core machine: the registry's Quarkus build 69 s against about 205 s, Flink's job-server
# classpath 86 s against 192 s, which is most of the time a fresh machine's first test waited.
MAVEN_VERSION = "3.9.16"
_MAVEN_SHA512 = (
    "831a8591fe20c8243b1dbe7d71e3244f31d1665b0804b2e825e38cbbe5ce0cafb8338851f90780735568773e0a6cd07bbec107cda0b896b0"
    "08b861075358b6f6"
)
_MAVEN_URL = "https://repo.maven.apache.org/maven2/org/apache/maven/apache-maven/{v}/apache-maven-{v}-bin.tar.gz"
_RESOLVER_FLAGS = (
    "-Daether.dependencyCollector.impl=bf",
    "-Daether.dependencyCollector.bf.threads=16",
    "-Dmaven.artifact.threads=16",
)

# Maven does not lock its local repository across processes by default: two mvn processes writing one repository at
# once can leave it corrupt. Flink's pieces (the job server's classpath, Beam's sources) are installed beside the
# other services' (``ServiceSet.prefetch``), so they resolve into a repository of their own; the others share "m2",
# one at a time.
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


def mvn(cache_dir: Path) -> list[str]:
    """The start of every Maven command here: Maven ``MAVEN_VERSION`` (fetched once into ``cache_dir/maven``, checked
    against its pinned SHA-512), in batch mode, with the parallel resolver on. Needs ``java`` on PATH."""
    if shutil.which("java") is None:
        raise ServiceError("Maven builds need `java` (17+) on PATH")
    home = cache_dir.resolve() / "maven" / f"apache-maven-{MAVEN_VERSION}"
    binary = home / "bin" / "mvn"
    if not binary.exists():
        with install_lock("maven", cache_dir.resolve()):
            if not binary.exists():
                _fetch_maven(home)
    return [str(binary), "-B", *_RESOLVER_FLAGS]


def _fetch_maven(home: Path) -> None:
    home.parent.mkdir(parents=True, exist_ok=True)
    url = _MAVEN_URL.format(v=MAVEN_VERSION)
    with tempfile.TemporaryDirectory(dir=home.parent) as tmp:
        archive = Path(tmp) / "maven.tar.gz"
        try:
            with urllib.request.urlopen(url, timeout=60) as response, open(archive, "wb") as out:
                shutil.copyfileobj(response, out)
        except OSError as exc:
            raise ServiceError(f"could not download Maven {MAVEN_VERSION} from {url}: {exc}") from exc
        digest = hashlib.sha512(archive.read_bytes()).hexdigest()
        if digest != _MAVEN_SHA512:
            raise ServiceError(f"Maven {MAVEN_VERSION} from {url} has SHA-512 {digest}, expected {_MAVEN_SHA512}")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        # Moved into place whole, so a killed download never leaves a half Maven that looks installed.
        (Path(tmp) / home.name).rename(home)


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
        *mvn(cache_dir),
        "-q",
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
        *mvn(cache_dir), "-q", f"-Dmaven.repo.local={cache_dir.resolve() / repo}",
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
