"""The clicks job against a hand-written single-process baseline doing the same work, same data, same run.

    .venv/bin/python -m benchmarks.e2e [--events 5000] [--json .data/bench/e2e.json] [--plot docs/benchmarks.png]

One topic is filled once with ``beamflow.generate`` traffic (skew, duplicate sends, late events, bad records, schema
v2). Each variant then reads all of it from the start, in its own subprocess (so peak RSS is its own), with its own
consumer group, PostgreSQL tables and Iceberg table:

- ``baseline``: a confluent-kafka consumer loop; Avro decode through the registry; event id from the identifying
  fields; dedup in a dict; one Iceberg append (plain pyiceberg) per commit interval and at the end; sessions (10-minute
  gap) per user computed in memory; sessions, duplicates and dead letters COPYed into PostgreSQL; offsets committed at
  the end. No exactly-once bookkeeping, no late panes, no replay safety: the floor of the work, not a product.
- ``beamflow``: ``pipelines.clicks`` on the pinned local runner (FnApiRunner), exactly as ``beamflow demo`` runs it.
- ``beamflow-head``: the same job with the committed (``git show HEAD:...``) versions of ``HEAD_FILES`` loaded in
  place of the working tree's, so a change to those transforms is measured before/after in one run.
- ``beamflow-nocache`` (not run by default): the SDK worker's state cache disabled; ``runners/direct.py`` now does
  that itself, so it measures the same code as ``beamflow`` (see docs/benchmarks.md).
- ``flink``: the same job, ``run_with_config(config, runner="FlinkRunner")``, on the local Flink session cluster that
  ``FlinkService`` starts under the same data folder (Beam's job server, LOOPBACK SDK workers in the variant's
  subprocess, the job server's jars staged as ``runners.flink.options_for_service`` does), in **batch** mode
  (``streaming: false``), parallelism 1 (see ``FLINK_BENCH`` for both). Its figures come in three parts:
  *submission* (``run_with_config`` called -> the Flink job's ``start-time``: pipeline construction, the job server's
  translation and the upload of about 100 MB of jars), the *job run* (``start-time`` -> ``end-time`` of
  ``/jobs/<id>``, as Flink records it), and the *total wall* of ``run_with_config``. Its throughput is given over the
  job run and over the total wall. Peak RSS is the submitting process's (pipeline construction plus the LOOPBACK
  Python workers); the Flink JVMs are not in it: their CPU seconds (``/proc/<pid>/stat`` before and after) and the
  TaskManager's RSS and heap (sampled every 0.5 s from ``/proc`` and Flink REST) are printed beside it.

While the beamflow variants run, a thread samples the group's committed offsets against the end offsets (consumer
lag over time). Printed: wall seconds, records/s, CPU seconds (user+sys of the subprocess), peak RSS, the ratios to the
baseline, and for beamflow the wall time per fused stage (FnApiRunner bundles timed from outside). After every variant
its sinks are audited: Iceberg rows and distinct event ids = produced events, quarantined rows = duplicate sends, dead
letters = bad records, sessions = the baseline's (and no session key twice), and the group's committed offsets = the
topic's end offsets on every partition.


Where each part lives: ``cli`` (arguments, services, the measuring loop), ``settings`` (variants, goal, the Flink
variant's options), ``variants`` (one variant in its subprocess), ``baseline`` (the hand-written floor), ``samplers``
(lag and JVM sampling), ``audit`` (the sinks after each variant) and ``report`` (what is printed).
"""

from __future__ import annotations

from benchmarks.e2e.audit import audit
from benchmarks.e2e.cli import _variant_config, main, run_variant

__all__ = ["_variant_config", "audit", "main", "run_variant"]
