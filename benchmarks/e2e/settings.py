"""The e2e benchmark's fixed settings: its variants, goal and the Flink variant's options."""

from __future__ import annotations

from typing import Any

VARIANTS = ("baseline", "beamflow-head", "beamflow", "flink")

# What the ``beamflow-head`` variant takes from git HEAD instead of the working tree.
HEAD_FILES = ("transforms/deduplicate.py", "transforms/hot_key_aggregate/")  # a module file or a package folder

GOAL = 0.5

# The baseline appends to Iceberg at most this often (the issue: "one Iceberg append per interval").
BASELINE_APPEND_INTERVAL_S = 5.0

# The ``flink`` variant's settings over conf/flink.yaml's section (plus the service's endpoint, LOOPBACK and jars).
# Batch, not streaming: this is a bounded read (kafka.bounded=true). In a streaming job a bounded source keeps its
# task running (and the job with it) unless shutdown_sources_after_idle_ms stops it, and with checkpointing on,
# output that fires only at the end of input (here every session and the bounded Iceberg commit) was seen to go
# missing on Beam 2.62 + Flink 1.19 (runners/flink.py); a streaming run would also take the stateful dedup and
# windowed-session paths, not the batch paths the DirectRunner variant measures. Batch runs the same code as the
# ``beamflow`` variant, and the job ends by itself when the input does.
# Parallelism 1, not conf/flink.yaml's 2: at 2 the batch job (55 vertices) failed over once in both runs tried on the
# default local cluster (TaskManager 1728m, 4,096 network buffers): a task asks for the 512 buffers Flink 1.19's
# sort-shuffle needs per blocking result partition while others hold the rest ("Insufficient number of network
# buffers"). The job then restarts that region and finishes, correct but with the failed attempt in its run time.
# ``--flink-parallelism 2`` measures that; the output flags a failover whenever one happens.
FLINK_BENCH: dict[str, Any] = {"streaming": False, "parallelism": 1}

# A variant's subprocess is ended after this long (a streaming Flink job whose source never finishes, say).
VARIANT_TIMEOUT_S = 900

# ``--flink-streaming``: a streaming job instead; its bounded source then stops only after this much idle time.
FLINK_STREAMING_IDLE_MS = 3000
