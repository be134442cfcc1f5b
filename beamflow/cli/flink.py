"""``beamflow flink jobs|savepoint|cancel|restore``: the Flink session cluster's jobs, over its REST API.

The cluster is the local one (``beamflow services up flink``) unless ``--rest http://host:port`` names another.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

from beamflow.flink_rest import FlinkRest, FlinkRestError
from beamflow.services import ServiceError, ServiceSet
from beamflow.services.beam_patches import SDF_RESIDUALS_JAR

# Why ``--drain`` is refused (Flink 1.19.3 + Beam 2.62, the fault drill in tests/flink/test_drills.py tries it every
# run and fails if it ever works): a draining stop must end every source and let every operator finish before its
# savepoint completes, but the streaming Kafka read is a splittable DoFn over an unbounded restriction: it always
# defers a residual and never reports itself done, so its stage never finishes and the draining savepoint expires
# ("CheckpointException: Checkpoint expired before completing", observed in the drill).
# Related upstream reports: apache/beam#28554 (drain fails on Flink with a watermark hold); Beam's drain support for
# Flink (apache/beam#38786) is for the Java SDK's PipelineResult, after 2.62.
DRAIN_REFUSED = (
    "--drain is not supported for Beam streaming jobs on this runner (Beam 2.62): the Kafka read never finishes, "
    "so Flink declines the draining savepoint; use `savepoint JOB --stop` (no data is lost: the restored job "
    "resumes from the savepoint and fires its windows then)"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("flink", help="list, savepoint, cancel and restore jobs on the Flink cluster")
    parser.add_argument("--rest", help="Flink REST address (default: the local FlinkService)")
    actions = parser.add_subparsers(dest="flink_action", required=True)

    actions.add_parser("jobs", help="list jobs with their state and checkpoint counts")

    savepoint = actions.add_parser("savepoint", help="take a savepoint of a running job (and stop it with --stop)")
    savepoint.add_argument("job_id", nargs="?", help="default: the one running job")
    savepoint.add_argument("--stop", action="store_true", help="stop the job after the savepoint (stop-with-savepoint)")
    savepoint.add_argument("--drain", action="store_true", help="refused: Beam 2.62 cannot drain streaming jobs")
    savepoint.add_argument("--dir", help="target folder (default: the cluster's state.savepoints.dir)")
    savepoint.add_argument("--timeout", type=float, default=300.0)

    cancel = actions.add_parser("cancel", help="cancel a job (its retained checkpoints stay restorable)")
    cancel.add_argument("job_id", nargs="?", help="default: the one running job")

    restore = actions.add_parser(
        "restore",
        help="print how to resume a pipeline from a savepoint or retained checkpoint",
        description="Beam's Flink job server restores a new submission from --savepoint_path (FlinkPipelineOptions); "
        "this prints the flags to add to the pipeline's command line.",
    )
    restore.add_argument("path", nargs="?", help="savepoint/checkpoint path (default: newest under the service)")
    restore.add_argument("--job-id", help="use the newest retained checkpoint of this job")
    restore.add_argument(
        "--allow-non-restored-state", action="store_true", help="allow state of operators no longer in the pipeline"
    )
    parser.set_defaults(func=run)


def _rest(args: argparse.Namespace) -> FlinkRest:
    if args.rest:
        return FlinkRest(args.rest)
    state = ServiceSet().get("flink").state()
    if state is None or "rest" not in state.ports or not state.alive():
        raise ServiceError("no local Flink is running; start it with `beamflow services up flink` or pass --rest")
    return FlinkRest(f"http://127.0.0.1:{state.ports['rest']}")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (FlinkRestError, ServiceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    action = args.flink_action
    if action == "savepoint" and args.drain:  # before any cluster is looked up: the answer does not depend on it
        print(f"error: {DRAIN_REFUSED}", file=sys.stderr)
        return 2
    if action == "restore":
        return _restore(args)
    rest = _rest(args)
    if action == "jobs":
        jobs = rest.jobs()
        if not jobs:
            print("no jobs")
        for job in jobs:
            started = datetime.fromtimestamp(job.start_time_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
            checkpoints = rest.checkpoints(job.job_id).get("counts", {})
            print(
                f"{job.job_id}  {job.state:10} started {started}Z  {job.duration_ms / 1000:8.1f}s  "
                f"checkpoints ok={checkpoints.get('completed', 0)} failed={checkpoints.get('failed', 0)}  {job.name}"
            )
            if job.state == "FAILED":  # why, in one line: the innermost cause, not the web UI's stack trace
                print(f"    failed: {rest.failure_cause(job.job_id) or '(Flink recorded no exception)'}")
    elif action == "savepoint":
        args.job_id = args.job_id or _running_job(rest)
        if args.stop:
            path = rest.stop_with_savepoint(args.job_id, args.dir, drain=args.drain, timeout=args.timeout)
        else:
            path = rest.wait_for_savepoint(args.job_id, rest.trigger_savepoint(args.job_id, args.dir), args.timeout)
        print(path)
    elif action == "cancel":
        args.job_id = args.job_id or _running_job(rest)
        rest.cancel(args.job_id)
        print(f"cancelling {args.job_id}")
    return 0


def _running_job(rest: FlinkRest) -> str:
    """The id of the one job that runs on the cluster (a command without a job id means it); else one clear line."""
    from beamflow.flink_rest import TERMINAL_STATES

    running = [job for job in rest.jobs() if job.state not in TERMINAL_STATES]
    if len(running) != 1:
        names = ", ".join(f"{job.job_id} ({job.name})" for job in running) or "none"
        raise ServiceError(f"{len(running)} running jobs ({names}): name the job id")
    return running[0].job_id


def _restore(args: argparse.Namespace) -> int:
    path = args.path
    if path is None and args.job_id:
        path = _rest(args).latest_checkpoint_path(args.job_id)
        if path is None:
            raise ServiceError(f"job {args.job_id} has no completed checkpoint")
    if path is None:
        path = _newest_savepoint()
    flags = [f"--savepoint_path={path}"]
    if args.allow_non_restored_state:
        flags.append("--allow_non_restored_state")
        # Beam 2.62 gives the read's Impulse no uid: on a runner without beamflow's patch jar its state can be the
        # state skipped, and then the impulse fires again and every partition is handed out a second time.
        print(
            "warning: skip only the state of operators you removed. On a cluster without beamflow's runner patch "
            f"({SDF_RESIDUALS_JAR}), a savepoint taken at parallelism 1 and restored at 2 or more (or the other way) "
            "skips the read's Impulse: every partition is then read twice (docs/deploying.md)."
        )
    print("Resubmit the pipeline with the same transform names and these extra flags:")
    print("  " + " ".join(shlex.quote(f) for f in flags))
    return 0


def _newest_savepoint() -> str:
    state = ServiceSet().get("flink").state()
    if state is None or "savepoints_dir" not in state.info:
        raise ServiceError("give a savepoint path (no local Flink state to look in)")
    candidates = sorted(Path(state.info["savepoints_dir"]).glob("savepoint-*"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise ServiceError(f"no savepoint under {state.info['savepoints_dir']}; give a path")
    return candidates[-1].as_uri()
