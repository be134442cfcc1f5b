"""A real schema registry: Apicurio Registry, built from Maven Central artifacts, serving the Confluent API.

Why it is built rather than just run: ``io.apicurio:apicurio-registry-app`` on Maven Central is a plain
jar of classes. A Quarkus application only runs after Quarkus' build step ("augmentation") has generated
its bootstrap classes, so ``install`` writes a tiny Maven project that unpacks the app jar as its own
classes, depends on the app's POM for the runtime dependencies and runs ``quarkus-maven-plugin:build``.
The result is the same ``-runner.jar`` + ``lib/`` the Apicurio project ships in its images.

Why 2.4.2.Final: the Maven Central reachable from here does not hold every module of every release. For
2.6.13.Final, 3.0.9 and 3.3.x some sibling modules (``apicurio-registry-schema-util-provider``,
``apicurio-common-app-components-*``, the parent POM, or the exact Quarkus version) are missing;
2.4.2.Final resolves completely with two substitutions made below: the JSON-schema validator (published
by Apicurio's build from JitPack) is taken from its Maven Central coordinates
``com.github.erosb:everit-json-schema`` (same code), and the ``config-index`` extension is pinned to
0.1.10.Final, the newest version whose deployment module is on Central. Storage is Apicurio's default
in-memory H2 database: every start is an empty registry.

TLS: besides plain HTTP (``info["url"]``, the local default) the registry serves HTTPS on a second loopback port
(``info["secure_url"]``) with a self-signed certificate made by ``beamflow.services.tls``; ``info["ca_file"]`` is
the certificate clients verify it with (``SchemaRegistryClient(url, ca_file=...)``, ``registry.ca_file`` in a job
config). Quarkus 2.16's properties: ``quarkus.http.ssl-port`` and ``quarkus.http.ssl.certificate.files`` /
``quarkus.http.ssl.certificate.key-files`` (PEM; the singular ``file`` / ``key-file`` are deprecated in 2.16);
``quarkus.http.host`` binds both servers, so HTTPS is loopback only like HTTP.

Why no HTTP basic auth: Apicurio 2.4's authentication (``registry.auth.enabled``) is OpenID Connect against a
Keycloak realm (``quarkus.oidc.auth-server-url`` = ``${registry.keycloak.url}/realms/${registry.keycloak.realm}``
in its ``application.properties``). Its "HTTP basic authentication" option
(``registry.auth.basic-auth-client-credentials.enabled``, which requires ``registry.auth.enabled=true``) is not a
user/password check of its own: ``AppAuthenticationMechanism`` (apicurio-common-app-components-auth 0.1.18.Final,
the version 2.4.2.Final runs) takes the Basic header's user and password as OAuth client credentials, fetches an
access token for them from ``registry.auth.token.endpoint`` (Keycloak's ``/protocol/openid-connect/token``) and
then authenticates that bearer token through Quarkus OIDC. The built application carries no other identity
provider for user/password (no ``quarkus-elytron-security-*``), so basic auth needs a running Keycloak (or another
OIDC server with a token endpoint), which this project cannot start here. Registry authentication stays off; the
registry listens on 127.0.0.1 only.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import requests

from beamflow.services.base import (
    LocalService,
    ServiceError,
    ServiceState,
    free_port,
    port_open,
    start_process,
    stop_process_group,
)
from beamflow.services.fetch import mvn
from beamflow.services.tls import self_signed_certificate

__all__ = ["APICURIO_VERSION", "RegistryService"]

APICURIO_VERSION = "2.4.2.Final"
QUARKUS_VERSION = "2.16.4.Final"  # the Quarkus release Apicurio 2.4.2.Final's parent POM builds with
CCOMPAT_PATH = "/apis/ccompat/v7"
# What a state written by this module holds; a running registry whose state says otherwise (one started by older
# code, e.g. without the HTTPS port) is not ready, so ``up()`` restarts it instead of handing it out.
STATE_LAYOUT = 2

# Apicurio's parent POM lists Confluent's and JitPack's repositories; only Maven Central is reachable, so
# every repository is mirrored to it (otherwise resolution stops at the first unknown host).
_SETTINGS = """<settings><mirrors><mirror><id>central-only</id><mirrorOf>*</mirrorOf>
<url>https://repo.maven.apache.org/maven2</url></mirror></mirrors></settings>
"""

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>beamflow.cache</groupId><artifactId>apicurio-registry-local</artifactId><version>1</version>
  <packaging>jar</packaging>
  <properties>
    <apicurio.version>{apicurio}</apicurio.version>
    <project.build.sourceEncoding>UTF-8</project.build.sourceEncoding>
  </properties>
  <dependencyManagement>
    <dependencies>
      <dependency><groupId>io.apicurio</groupId><artifactId>apicurio-common-app-components-config-index</artifactId>
        <version>0.1.10.Final</version></dependency>
      <dependency><groupId>io.quarkus</groupId><artifactId>quarkus-bom</artifactId>
        <version>{quarkus}</version><type>pom</type><scope>import</scope></dependency>
      <dependency><groupId>io.apicurio</groupId><artifactId>apicurio-registry</artifactId>
        <version>${{apicurio.version}}</version><type>pom</type><scope>import</scope></dependency>
    </dependencies>
  </dependencyManagement>
  <dependencies>
    <!-- type=pom: the app's runtime dependencies without its jar (unpacked below as our classes) -->
    <dependency><groupId>io.apicurio</groupId><artifactId>apicurio-registry-app</artifactId>
      <version>${{apicurio.version}}</version><type>pom</type>
      <exclusions><exclusion><groupId>com.github.everit-org.json-schema</groupId>
        <artifactId>org.everit.json.schema</artifactId></exclusion></exclusions></dependency>
    <dependency><groupId>com.github.erosb</groupId><artifactId>everit-json-schema</artifactId>
      <version>1.14.2</version></dependency>
  </dependencies>
  <build>
    <plugins>
      <plugin>
        <groupId>org.apache.maven.plugins</groupId><artifactId>maven-dependency-plugin</artifactId>
        <version>3.6.1</version>
        <executions><execution><id>unpack-app</id><phase>process-resources</phase><goals><goal>unpack</goal></goals>
          <configuration><artifactItems><artifactItem>
            <groupId>io.apicurio</groupId><artifactId>apicurio-registry-app</artifactId>
            <version>${{apicurio.version}}</version><type>jar</type>
            <outputDirectory>${{project.build.outputDirectory}}</outputDirectory>
          </artifactItem></artifactItems></configuration></execution></executions>
      </plugin>
      <plugin>
        <groupId>io.quarkus</groupId><artifactId>quarkus-maven-plugin</artifactId><version>{quarkus}</version>
        <executions><execution><goals><goal>build</goal></goals></execution></executions>
      </plugin>
    </plugins>
  </build>
</project>
"""

# Small heap, serial GC and C1 only: the registry holds a handful of schemas; CI machines have few cores.
_JVM_FLAGS = ["-Xms64m", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xss512k"]


class RegistryService(LocalService):
    """Apicurio Registry on 127.0.0.1, in-memory storage; ``info['url']`` is the Confluent-compatible base over HTTP,
    ``info['secure_url']`` the same over HTTPS (``ports['https']``), verified with ``info['ca_file']``."""

    name = "registry"
    start_timeout = 180.0

    @property
    def dist_dir(self) -> Path:
        return self.cache_dir / "apicurio" / APICURIO_VERSION

    @property
    def runner_jar(self) -> Path:
        return self.dist_dir / "apicurio-registry-local-1-runner.jar"

    def install(self) -> None:
        stamp = self.dist_dir / ".complete"
        if stamp.exists() and self.runner_jar.exists():
            return
        build = self.cache_dir / "apicurio" / f"build-{APICURIO_VERSION}"
        shutil.rmtree(build, ignore_errors=True)
        build.mkdir(parents=True)
        (build / "pom.xml").write_text(_POM.format(apicurio=APICURIO_VERSION, quarkus=QUARKUS_VERSION))
        (build / "settings.xml").write_text(_SETTINGS)
        cmd = [
            *mvn(self.cache_dir),
            "-q",
            "-s",
            str(build / "settings.xml"),
            "-f",
            str(build / "pom.xml"),
            f"-Dmaven.repo.local={self.cache_dir / 'm2'}",
            "-DskipTests",
            "package",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        built = build / "target" / self.runner_jar.name
        if result.returncode != 0 or not built.exists():
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-20:])
            raise ServiceError(f"building Apicurio Registry {APICURIO_VERSION} with Quarkus failed:\n{tail}")
        shutil.rmtree(self.dist_dir, ignore_errors=True)
        self.dist_dir.mkdir(parents=True)
        shutil.copy2(built, self.runner_jar)
        # The runner jar's manifest class path points at lib/ beside it.
        shutil.copytree(build / "target" / "lib", self.dist_dir / "lib")
        shutil.rmtree(build, ignore_errors=True)
        stamp.write_text(f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION} Quarkus {QUARKUS_VERSION}\n")

    def _start(self) -> ServiceState:
        port = free_port()
        ssl_port = free_port()
        while ssl_port == port:
            ssl_port = free_port()
        cert, key = self_signed_certificate(self.home / "tls", "registry", owner="Apicurio Registry")
        java = shutil.which("java") or "java"
        argv = [
            java,
            *_JVM_FLAGS,
            f"-Dquarkus.http.port={port}",
            "-Dquarkus.http.host=127.0.0.1",  # both servers, HTTP and HTTPS
            # HTTPS beside HTTP (quarkus.http.insecure-requests keeps its default, enabled), PEM certificate and key.
            f"-Dquarkus.http.ssl-port={ssl_port}",
            f"-Dquarkus.http.ssl.certificate.files={cert}",
            f"-Dquarkus.http.ssl.certificate.key-files={key}",
            # Apicurio's UI and metrics are not used; fewer things to start.
            "-Dregistry.ui.features.readOnly=true",
            "-Dquarkus.micrometer.enabled=false",
            "-jar",
            str(self.runner_jar),
        ]
        started = time.monotonic()
        proc = start_process(argv, self.home / "registry.log", cwd=self.home)
        url = f"http://127.0.0.1:{port}{CCOMPAT_PATH}"
        state = ServiceState(
            name=self.name,
            pids=[proc.pid],
            ports={"http": port, "https": ssl_port},
            info={
                "url": url,
                "api_url": f"http://127.0.0.1:{port}/apis/registry/v2",
                "secure_url": f"https://127.0.0.1:{ssl_port}{CCOMPAT_PATH}",
                "ca_file": str(cert),
                "version": APICURIO_VERSION,
                "layout": STATE_LAYOUT,
            },
        )

        # Polled by hand, not with wait_until: a JVM that exits must fail the start at once, with its log.
        deadline = started + self.start_timeout
        while True:
            if proc.poll() is not None:
                log = (self.home / "registry.log").read_text(errors="replace").splitlines()[-20:]
                raise ServiceError(f"Apicurio Registry exited with {proc.returncode}:\n" + "\n".join(log))
            try:
                if self.ready(state):
                    break
            except requests.RequestException:
                pass  # not listening yet
            if time.monotonic() > deadline:
                stop_process_group(proc.pid)
                raise ServiceError(f"Apicurio Registry gave no answer at {url} in {self.start_timeout:.0f}s")
            time.sleep(0.5)
        state.info["startup_seconds"] = round(time.monotonic() - started, 2)
        return state

    def ready(self, state: ServiceState) -> bool:
        """The Confluent API answers over HTTP and the HTTPS port listens. A state from older code (another
        ``layout``, no HTTPS port) is never ready: ``up()`` then stops that registry and starts this one."""
        if state.info.get("layout") != STATE_LAYOUT or "https" not in state.ports:
            return False
        response = requests.get(f"{state.info['url']}/subjects", timeout=5)
        return response.status_code == 200 and isinstance(response.json(), list) and port_open(state.ports["https"])
