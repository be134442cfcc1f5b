"""Beam 2.62's portable Flink runner, patched at setup so a self-checkpointing splittable DoFn's state stays bounded.

The bug (apache/beam#27648, read in 2.62's sources and measured by ``benchmarks/soak.py``): when a splittable DoFn
defers (beamflow's Kafka read does after 20,000 records or 1 s of each call), the runner's
``BundleCheckpointHandlers.StateAndTimerBundleCheckpointHandler`` stores the residual under a keyed value state named
after a counter (``sdf_checkpoint:<n>:<index>``), and ``ExecutableStageDoFnOperator`` reads it back when the timer
fires and never clears it. Each read call of each partition leaves a new state behind for good (on RocksDB, a new
column family), so the job's checkpoint grew from 0.97 MB at minute 2 to 6.03 MB at minute 10 of a soak at
100 records/s, and the TaskManagers' memory with it. Upstream fixed it in a later release (apache/beam#39191: one
map state per key and window, entries removed when consumed); beamflow pins 2.62 (pyiceberg's pyarrow range), so
the same idea is applied here to 2.62's own sources:

* the handler puts each residual into one map state (``beamflow_sdf_residuals``), keyed by its timer id;
* the streaming operator's ``onTimer`` takes the residual out of that map (read, then removed). A residual written by
  an unpatched runner (a checkpoint or savepoint taken before this patch) is still found under its old value state,
  read and cleared, so a restore from it continues the read instead of dropping its restriction;
* the batch function (``FlinkExecutableStageFunction``) reads the map the same way.

The same jar carries a second fix (``WATERMARK_ORDER_PATCHES``): Beam 2.62's ``ExecutableStageDoFnOperator`` holds
the watermark while a bundle runs and advances it from the bundle's finish callback. When a checkpoint barrier
finishes that bundle, ``DoFnOperator.snapshotState`` buffers the bundle's output (the barrier has already gone
downstream) and the callback then emits the held watermark at once, ahead of the buffered output, which reaches the
next operator late or, if nothing else ever reaches this operator, never. Seen as a streaming read that started and
never read: its Impulse's element started the first bundle, the +inf watermark came right behind it, a barrier
finished the bundle, and the partitions it had found stayed in the buffer while +inf ran through the whole job
(``tests/flink/test_watermark_order.py`` makes the moment certain: the unpatched runner loses the bundle's output
every time). Patched: while the buffer is open, the callback schedules the watermark for after the snapshot, when
``processWatermark1`` flushes the buffer before it emits the watermark.

A third (``IMPULSE_ID_PATCHES``) keeps savepoints restorable at any parallelism. Beam 2.62 names its streaming
operators' uids after their transforms but gives the Impulse that starts a read none, so Flink generates its id from
the graph, and the graph differs at parallelism 1, where the Impulse (always one subtask) is chained with the next
operator. Measured on the clicks job: a savepoint taken at 1 was refused at 2 ("Cannot map checkpoint/savepoint
state for operator ..."), and with ``allow_non_restored_state`` the impulse fired again and the watcher handed every
partition out a second time. Patched: the Impulse is never chained, so at 1 it gets the id it already had at 2 or
more (the same vertex id in the job graph before and after the patch at 2), and savepoints restore from 1 to 2 and
from 2 to 1 (``tests/flink/test_drills.py``'s restore drill restores a parallelism-2 savepoint at 1).

How: the source files are taken from Beam's ``-sources`` jars on Maven Central, each edit must match exactly
once (else one error line: a new Beam must not build unpatched), the files are compiled against the job server's
classpath and jarred as ``0-beamflow-sdf-residuals.jar``, which ``FlinkService`` puts first in the cluster's
``lib/`` and on the job server's classpath (Flink's ``config.sh`` loads ``lib/`` in sorted order; jobs ship no Beam
jar), the same way as the loopback ``ServerFactory``. ``tests/flink/test_sdf_residuals.py`` shows the unpatched
handler leaving one state per deferral and the patched one leaving none.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from beamflow.services.base import ServiceError
from beamflow.services.fetch import FLINK_MAVEN_REPO, maven_artifact
from beamflow.services.gobuild import SourcePatch, patched_text

__all__ = [
    "IMPULSE_ID_PATCHES",
    "RUNNER_PATCHES",
    "SDF_RESIDUALS_JAR",
    "SDF_RESIDUAL_PATCHES",
    "WATERMARK_ORDER_PATCHES",
    "CheckpointResidualStates",
    "checkpoint_residual_states",
    "sdf_residual_sources",
]

SDF_RESIDUALS_JAR = "0-beamflow-sdf-residuals.jar"
# The map state's id: one per key and window, whatever the number of deferrals.
RESIDUALS_STATE_ID = "beamflow_sdf_residuals"

_HANDLER = "org/apache/beam/runners/fnexecution/control/BundleCheckpointHandlers.java"
_OPERATOR = "org/apache/beam/runners/flink/translation/wrappers/streaming/ExecutableStageDoFnOperator.java"
_BATCH = "org/apache/beam/runners/flink/translation/functions/FlinkExecutableStageFunction.java"
_DOFN_OPERATOR = "org/apache/beam/runners/flink/translation/wrappers/streaming/DoFnOperator.java"
_TRANSLATOR = "org/apache/beam/runners/flink/FlinkStreamingPortablePipelineTranslator.java"

# Which sources jar holds which file (artifact ids of Maven Central).
_SOURCE_ARTIFACTS = {
    _HANDLER: "beam-runners-java-fn-execution",
    _OPERATOR: "beam-runners-flink-1.19",
    _BATCH: "beam-runners-flink-1.19",
    _DOFN_OPERATOR: "beam-runners-flink-1.19",
    _TRANSLATOR: "beam-runners-flink-1.19",
}

SDF_RESIDUAL_PATCHES: tuple[SourcePatch, ...] = (
    # A SpotBugs annotation (class retention, no effect at run time) whose jar the runtime classpath lacks.
    SourcePatch(_OPERATOR, "import edu.umd.cs.findbugs.annotations.SuppressFBWarnings;\n", ""),
    SourcePatch(_OPERATOR, '@SuppressFBWarnings("SE_TRANSIENT_FIELD_NOT_RESTORED")\n', ""),
    SourcePatch(
        _HANDLER,
        "import org.apache.beam.runners.core.StateTags;\n",
        "import org.apache.beam.runners.core.StateTag;\n"
        "import org.apache.beam.runners.core.StateTags;\n"
        "import org.apache.beam.sdk.coders.StringUtf8Coder;\n"
        "import org.apache.beam.sdk.state.MapState;\n",
    ),
    SourcePatch(
        _HANDLER,
        "    private static String constructSdfCheckpointId(String id, int index) {\n",
        "    /**\n"
        "     * beamflow (apache/beam#27648): every residual of a key and window lives in this one map state,\n"
        "     * keyed by its timer id, instead of a value state per residual that nothing ever clears.\n"
        "     */\n"
        "    public static <V> StateTag<MapState<String, V>> residualsTag(Coder<V> residualCoder) {\n"
        f'      return StateTags.map("{RESIDUALS_STATE_ID}", StringUtf8Coder.of(), residualCoder);\n'
        "    }\n"
        "\n"
        "    private static String constructSdfCheckpointId(String id, int index) {\n",
    ),
    SourcePatch(
        _HANDLER,
        "                .state(stateNamespace, StateTags.value(tag, residualCoder))\n                .write(\n",
        "                .state(stateNamespace, residualsTag(residualCoder))\n"
        "                .put(\n"
        "                    tag,\n",
    ),
    SourcePatch(
        _OPERATOR,
        "        WindowedValue stateValue =\n"
        "            keyedStateInternals.state(namespace, StateTags.value(timerId, residualCoder)).read();\n"
        "        processElement(stateValue);\n",
        "        // beamflow (apache/beam#27648): the residual is taken out of the map, so nothing stays behind.\n"
        "        org.apache.beam.sdk.state.MapState<String, WindowedValue<InputT>> residuals =\n"
        "            keyedStateInternals.state(\n"
        "                namespace, StateAndTimerBundleCheckpointHandler.residualsTag(residualCoder));\n"
        "        WindowedValue<InputT> stateValue = residuals.get(timerId).read();\n"
        "        residuals.remove(timerId);\n"
        "        if (stateValue == null) {\n"
        "          // Written by an unpatched runner before a restore: its own value state, cleared once read.\n"
        "          org.apache.beam.sdk.state.ValueState<WindowedValue<InputT>> unpatched =\n"
        "              keyedStateInternals.state(namespace, StateTags.value(timerId, residualCoder));\n"
        "          stateValue = unpatched.read();\n"
        "          unpatched.clear();\n"
        "        }\n"
        "        processElement(stateValue);\n",
    ),
    SourcePatch(
        _BATCH,
        "            WindowedValue stateValue =\n"
        "                sdfStateInternals\n"
        "                    .state(timer.getNamespace(), StateTags.value(timer.getTimerId(), inputCoder))\n"
        "                    .read();\n",
        "            // beamflow (apache/beam#27648): residuals live in one map state, taken out when fired.\n"
        "            org.apache.beam.sdk.state.MapState<String, WindowedValue<InputT>> stored =\n"
        "                sdfStateInternals.state(\n"
        "                    timer.getNamespace(),\n"
        "                    BundleCheckpointHandlers.StateAndTimerBundleCheckpointHandler.residualsTag(\n"
        "                        inputCoder));\n"
        "            WindowedValue stateValue = stored.get(timer.getTimerId()).read();\n"
        "            stored.remove(timer.getTimerId());\n",
    ),
)


# The second fix the jar carries: a bundle's output must never fall behind the watermark (see the module docstring).
WATERMARK_ORDER_PATCHES: tuple[SourcePatch, ...] = (
    SourcePatch(_DOFN_OPERATOR, "import edu.umd.cs.findbugs.annotations.SuppressFBWarnings;\n", ""),
    SourcePatch(_DOFN_OPERATOR, '@SuppressFBWarnings("SE_TRANSIENT_FIELD_NOT_RESTORED")\n', ""),
    SourcePatch(_DOFN_OPERATOR, '  @SuppressFBWarnings("VO_VOLATILE_INCREMENT")\n', ""),
    SourcePatch(
        _DOFN_OPERATOR,
        "    void closeBuffer() {\n",
        "    /** beamflow: true while snapshotState() buffers a finishing bundle's output. */\n"
        "    boolean isBufferOpen() {\n"
        "      return openBuffer;\n"
        "    }\n"
        "\n"
        "    void closeBuffer() {\n",
    ),
    SourcePatch(
        _OPERATOR,
        "      if (!closed\n"
        "          && minEventTimeTimerTimestampInLastBundle < Long.MAX_VALUE\n"
        "          && minEventTimeTimerTimestampInLastBundle <= getEffectiveInputWatermark()) {\n",
        "      // beamflow: a bundle finished by snapshotState() has its output buffered until the snapshot is\n"
        "      // taken; advancing the watermark now would send it downstream ahead of that output, which then\n"
        "      // arrives late (a final +inf watermark made the output of a read's first bundle vanish). After the\n"
        "      // snapshot, processWatermark1 flushes the buffer first and then emits the watermark.\n"
        "      if (!closed\n"
        "          && (outputManager.isBufferOpen()\n"
        "              || (minEventTimeTimerTimestampInLastBundle < Long.MAX_VALUE\n"
        "                  && minEventTimeTimerTimestampInLastBundle <= getEffectiveInputWatermark()))) {\n",
    ),
)

# The Impulse never chained, so its generated operator id is the same at any parallelism (the module docstring).
IMPULSE_ID_PATCHES: tuple[SourcePatch, ...] = (
    # AutoService writes a META-INF/services entry at compile time; Beam's own jar already carries it for this class,
    # and the annotation processor is not on the job server's classpath.
    SourcePatch(_TRANSLATOR, "import com.google.auto.service.AutoService;\n", ""),
    SourcePatch(_TRANSLATOR, "  @AutoService(NativeTransforms.IsNativeTransform.class)\n", ""),
    SourcePatch(
        _TRANSLATOR,
        """            .addSource(new ImpulseSourceFunction(shutdownAfterIdleSourcesMs), "Impulse")
            .returns(typeInfo);
""",
        """            .addSource(new ImpulseSourceFunction(shutdownAfterIdleSourcesMs), "Impulse")
            .returns(typeInfo)
            .disableChaining(); // beamflow: the same operator id at any parallelism (see beam_patches.py)
""",
    ),
)

# Every patch of the jar, in order (several touch one file).
RUNNER_PATCHES: tuple[SourcePatch, ...] = SDF_RESIDUAL_PATCHES + WATERMARK_ORDER_PATCHES + IMPULSE_ID_PATCHES


def sdf_residual_sources(beam_version: str, cache_dir: Path) -> Path:
    """A folder holding the three Java files of Beam ``beam_version`` with ``SDF_RESIDUAL_PATCHES`` applied:
    ``<cache>/beam-patches/sdf-residuals-<version>`` (a fixed path: docs/deploying/Dockerfile compiles it too),
    rewritten when the patches change (its ``.patches`` file holds their hash)."""
    key = hashlib.sha256(
        json.dumps(
            [beam_version, sorted(_SOURCE_ARTIFACTS.items()), [[p.file, p.old, p.new] for p in RUNNER_PATCHES]]
        ).encode()
    ).hexdigest()[:16]
    target = cache_dir / "beam-patches" / f"sdf-residuals-{beam_version}"
    stamp = target / ".patches"
    if stamp.exists() and stamp.read_text().strip() == key:
        return target
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    for file, artifact in _SOURCE_ARTIFACTS.items():
        sources_jar = maven_artifact(
            f"org.apache.beam:{artifact}:{beam_version}:jar:sources", cache_dir, FLINK_MAVEN_REPO
        )
        with zipfile.ZipFile(sources_jar) as jar:
            try:
                text = jar.read(file).decode()
            except KeyError:
                raise ServiceError(
                    f"{sources_jar.name} has no {file}; review beam_patches for Beam {beam_version}"
                ) from None
        (staging / file).parent.mkdir(parents=True, exist_ok=True)
        (staging / file).write_text(text)
    for patch in RUNNER_PATCHES:  # in order; several patches touch one file
        (staging / patch.file).write_text(patched_text(staging, patch, "beam", beam_version))
    (staging / ".patches").write_text(key + "\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


# The name an unpatched runner gives each residual's value state (Beam 2.62's StateAndTimerBundleCheckpointHandler).
_PER_DEFERRAL_STATE = re.compile(rb"sdf_checkpoint:[0-9]+:[0-9]+")


@dataclass(frozen=True)
class CheckpointResidualStates:
    """What one completed checkpoint holds of splittable-DoFn residual state, by state name."""

    per_deferral: frozenset[str]  # one value state per deferral: the unbounded growth (unpatched runner)
    residual_map: bool  # the one map state per key and window of the patched runner


def checkpoint_residual_states(checkpoint: Path) -> CheckpointResidualStates:
    """Reads the state names of a completed checkpoint folder (``chk-N``) and sorts out the residual ones.

    The names come from the keyed backends' state meta data, which Flink writes as files of their own beside
    ``_metadata`` (above ``state.storage.fs.memory-threshold``, 20 KB; the clicks job's are 35-250 KB). ``_metadata``
    itself is not read: it also inlines small RocksDB data files, whose keys carry timer ids that look the same but
    are pending timers, not states. A job on the patched runner checkpoints no ``sdf_checkpoint:<n>:<i>`` state; on
    Beam 2.62's own, their number grows with every deferral of every partition (measured: 91 after 2 minutes of a
    4-partition read).
    """
    per_deferral: set[str] = set()
    residual_map = False
    for path in sorted(checkpoint.iterdir()):
        if path.is_file() and path.name != "_metadata":
            data = path.read_bytes()
            per_deferral.update(m.decode() for m in _PER_DEFERRAL_STATE.findall(data))
            residual_map = residual_map or RESIDUALS_STATE_ID.encode() in data
    return CheckpointResidualStates(frozenset(per_deferral), residual_map)
