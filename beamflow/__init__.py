"""beamflow: exactly-once Kafka-to-warehouse streaming with Apache Beam on Flink.

The engines in this package (Kafka client adapter, Iceberg committer, PostgreSQL writer, Avro and schema registry,
config, services) know nothing of Beam where they can; the public PTransforms live in the top-level ``transforms``
package.
"""

__version__ = "0.1.0"
