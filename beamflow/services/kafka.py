"""Apache Kafka 4.x, single-node KRaft, from Maven Central jars.

Done the way Kafka's own ``bin/kafka-storage.sh`` and ``bin/kafka-server-start.sh`` do it, without the tarball (which
this machine cannot download): resolve ``org.apache.kafka:kafka_2.13`` with its runtime dependencies into the cache,
format the log directory once with ``kafka.tools.StorageTool``, start ``kafka.Kafka`` as a combined broker+controller
listening on 127.0.0.1. The log directory survives ``down``/``up`` (the broker keeps its data across restarts).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from beamflow.services.base import (
    LocalService,
    ServiceError,
    ServiceState,
    free_port,
    start_process,
    wait_for_port,
    wait_until,
)
from beamflow.services.fetch import maven_classpath

__all__ = ["KAFKA_VERSION", "SECURE_USER", "KafkaService"]

KAFKA_VERSION = "4.4.0"
SECURE_USER = "beamflow"  # the SASL_SSL listener's SCRAM-SHA-512 user
_COORDINATES = [
    f"org.apache.kafka:kafka_2.13:{KAFKA_VERSION}",
    # Kafka 4 logs through SLF4J 2 + Log4j 2; pin the API so Maven's nearest-wins does not pick SLF4J 1.7.
    "org.slf4j:slf4j-api:2.0.17",
    "org.apache.logging.log4j:log4j-slf4j2-impl:2.25.5",
]

_LOG4J2 = """status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
"""


class KafkaService(LocalService):
    """A single-node KRaft broker on 127.0.0.1 with data under ``<data>/kafka``.

    ``state.ports``: ``broker`` (client listener), ``controller`` and ``sasl_ssl``; ``state.info["bootstrap"]`` is
    the bootstrap address clients use. The second client listener, ``info["secure_bootstrap"]``, takes SASL_SSL with
    SCRAM-SHA-512 only: a keystore made with keytool at the first start (its certificate is the clients' CA) and the
    user ``beamflow`` whose password is in ``<home>/secure/client-password``; ``info["secure_client_config"]`` are
    the client settings, the password given as ``file:...`` (resolved where a client is made, beamflow/secrets.py).
    """

    name = "kafka"
    default_partitions = 4

    @property
    def classpath(self) -> str:
        return str(self.cache_dir / "jars" / f"kafka-{KAFKA_VERSION}") + "/*"

    def install(self) -> None:
        maven_classpath(f"kafka-{KAFKA_VERSION}", _COORDINATES, self.cache_dir)

    def _java(self, main: str, *args: str, heap: str = "-Xmx512m") -> list[str]:
        log4j = self.home / "log4j2.properties"
        return [
            "java",
            heap,
            "-XX:+UseG1GC",
            f"-Dlog4j2.configurationFile={log4j}",
            "-cp",
            self.classpath,
            main,
            *args,
        ]

    @property
    def secure_dir(self) -> Path:
        return self.home / "secure"

    def _secret(self, name: str) -> Path:
        """A random secret in ``<home>/secure/<name>`` (mode 600), made once."""
        import secrets

        self.secure_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.secure_dir, 0o700)
        path = self.secure_dir / name
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(24))
        return path

    def _keystore(self) -> tuple[Path, str, Path]:
        """The SASL_SSL listener's PKCS12 keystore (EC P-256, for 127.0.0.1 and localhost), its password, and the
        certificate as PEM for clients' ``ssl.ca.location``; made once with the JDK's keytool."""
        store, cert = self.secure_dir / "broker.p12", self.secure_dir / "broker-cert.pem"
        password = self._secret("keystore-password").read_text()
        if store.exists() and cert.exists():
            return store, password, cert
        keytool = shutil.which("keytool")
        if keytool is None:
            raise ServiceError("Kafka's TLS keystore is made with the JDK's `keytool` (openjdk-17-jdk-headless)")
        store.unlink(missing_ok=True)
        for argv in (
            ["-genkeypair", "-alias", "broker", "-keyalg", "EC", "-groupname", "secp256r1", "-validity", "3650",
             "-dname", "CN=127.0.0.1", "-ext", "SAN=IP:127.0.0.1,DNS:localhost",
             "-keystore", str(store), "-storetype", "PKCS12", "-storepass", password],
            ["-exportcert", "-rfc", "-alias", "broker", "-keystore", str(store), "-storepass", password,
             "-file", str(cert)],
        ):  # fmt: skip
            result = subprocess.run([keytool, *argv], capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise ServiceError(f"keytool could not make Kafka's keystore: {(result.stdout + result.stderr)[-500:]}")
        return store, password, cert

    def _write_config(self, broker_port: int, controller_port: int, secure_port: int) -> Path:
        logs = self.home / "logs"
        props = self.home / "server.properties"
        store, store_password, _ = self._keystore()
        props.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}",
                    f"listeners=PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port},"
                    f"SASL_SSL://127.0.0.1:{secure_port}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{broker_port},SASL_SSL://127.0.0.1:{secure_port}",
                    "controller.listener.names=CONTROLLER",
                    "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_SSL:SASL_SSL",
                    # The second listener: TLS with SCRAM-SHA-512 logins (users created after start, see _start).
                    "sasl.enabled.mechanisms=SCRAM-SHA-512",
                    "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config="
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;",
                    "listener.name.sasl_ssl.ssl.keystore.type=PKCS12",
                    f"listener.name.sasl_ssl.ssl.keystore.location={store}",
                    f"listener.name.sasl_ssl.ssl.keystore.password={store_password}",
                    "inter.broker.listener.name=PLAINTEXT",
                    f"log.dirs={logs}",
                    f"num.partitions={self.default_partitions}",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=4",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "share.coordinator.state.topic.replication.factor=1",
                    "share.coordinator.state.topic.min.isr=1",
                    "group.initial.rebalance.delay.ms=0",
                    # Large values are part of the contract tests (near the broker's maximum size).
                    "message.max.bytes=2097152",
                    "replica.fetch.max.bytes=2097152",
                    "auto.create.topics.enable=false",
                    # Generated and replayed traffic carries old timestamps; time-based retention would delete it.
                    "log.retention.ms=-1",
                    "",
                ]
            )
        )
        (self.home / "log4j2.properties").write_text(_LOG4J2.format(log=self.home / "server.log"))
        return props

    def _start(self) -> ServiceState:
        previous = self.state()
        # Keep the ports of an earlier run so a restarted broker is the same broker to its clients.
        broker_port = previous.ports.get("broker") if previous and previous.ports else None
        controller_port = previous.ports.get("controller") if previous and previous.ports else None
        secure_port = previous.ports.get("sasl_ssl") if previous and previous.ports else None
        broker_port = broker_port or free_port()
        controller_port = controller_port or free_port()
        while not secure_port or secure_port in (broker_port, controller_port):
            secure_port = free_port()
        props = self._write_config(broker_port, controller_port, secure_port)
        if not (self.home / "logs" / "meta.properties").exists():
            cluster_id = subprocess.run(
                self._java("kafka.tools.StorageTool", "random-uuid", heap="-Xmx128m"),
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()[-1]
            result = subprocess.run(
                self._java(
                    "kafka.tools.StorageTool",
                    "format",
                    "--standalone",
                    "-t",
                    cluster_id,
                    "-c",
                    str(props),
                    heap="-Xmx128m",
                ),
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0:
                raise ServiceError(f"Kafka StorageTool format failed: {result.stdout}{result.stderr}")
        proc = start_process(self._java("kafka.Kafka", str(props)), self.home / "stdout.log")
        state = ServiceState(
            name=self.name,
            pids=[proc.pid],
            ports={"broker": broker_port, "controller": controller_port, "sasl_ssl": secure_port},
            info={
                "bootstrap": f"127.0.0.1:{broker_port}",
                "version": KAFKA_VERSION,
                # The SASL_SSL listener: client settings with the password by reference (beamflow/secrets.py).
                "secure_bootstrap": f"127.0.0.1:{secure_port}",
                "secure_client_config": {
                    "security.protocol": "SASL_SSL",
                    "sasl.mechanism": "SCRAM-SHA-512",
                    "sasl.username": SECURE_USER,
                    "sasl.password": f"file:{self._secret('client-password')}",
                    "ssl.ca.location": str(self._keystore()[2]),
                },
            },
        )
        try:
            wait_for_port(broker_port, 90, "Kafka broker")
            wait_until(lambda: self.ready(state), 60, "Kafka metadata")
            self._create_scram_user(state.info["bootstrap"], self._secret("client-password").read_text())
        except ServiceError:
            log_tail = (self.home / "stdout.log").read_text(errors="replace")[-3000:]
            raise ServiceError(f"Kafka did not start; log tail:\n{log_tail}") from None
        return state

    @staticmethod
    def _create_scram_user(bootstrap: str, password: str) -> None:
        """The SASL_SSL listener's user, created (or its password set) through the plaintext listener."""
        from confluent_kafka.admin import (
            AdminClient,
            ScramCredentialInfo,
            ScramMechanism,
            UserScramCredentialUpsertion,
        )

        admin = AdminClient({"bootstrap.servers": bootstrap})
        upsert = UserScramCredentialUpsertion(
            SECURE_USER, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), password.encode()
        )
        for future in admin.alter_user_scram_credentials([upsert]).values():
            future.result(timeout=30)

    def ready(self, state: ServiceState) -> bool:
        """Metadata answers and the group coordinator is loaded (a fresh broker answers offset requests with
        NOT_COORDINATOR / COORDINATOR_LOAD_IN_PROGRESS for a while after it starts listening)."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(
            {"bootstrap.servers": state.info["bootstrap"], "group.id": "beamflow-ready", "enable.auto.commit": False}
        )
        try:
            metadata = consumer.list_topics(timeout=5)
            if not metadata.brokers:
                return False
            consumer.committed([TopicPartition("beamflow-ready", 0)], timeout=5)
            return True
        finally:
            consumer.close()
