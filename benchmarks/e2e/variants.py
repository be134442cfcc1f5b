"""One variant, run in its own subprocess (``python -m benchmarks.e2e --child VARIANT CONFIG``): the clicks job on the
local runner (timed per fused stage), on Flink, with HEAD's transforms, or the baseline; prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from beamflow.process_memory import own_peak_rss_mb, proc_rss_mb
from benchmarks.e2e.settings import HEAD_FILES


def _usage(children_peak_mb: float = 0.0) -> dict[str, float]:
    """CPU seconds of this process and of the children it waited for (a local run split over processes); peak
    memory: this process's own plus ``children_peak_mb`` (the sum of the children's own peaks: at most overstated)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    return {"cpu_s": cpu_s, "peak_rss_mb": own_peak_rss_mb() + children_peak_mb}  # not ru_maxrss: see there


class StageClock:
    """Wall seconds, bundles and memory per fused stage of FnApiRunner, by wrapping its bundle execution
    (measurement only). ``rss_mb``: the process's resident MB when the stage's bundles ended, the largest; read in
    stage order, it shows which stage's data grows with the input (FnApiRunner keeps every stage's output in memory
    until the stages that read it have run).

    A fused stage runs several transforms in one bundle; it is named here by the top-level transforms it contains.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.bundles: dict[str, int] = defaultdict(int)
        self.rss_mb: dict[str, float] = defaultdict(float)

    def install(self) -> None:
        from apache_beam.runners.portability.fn_api_runner import fn_runner

        original = fn_runner.FnApiRunner._execute_bundle
        clock = self

        def timed(runner: Any, context: Any, bundle_context_manager: Any, bundle_input: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(runner, context, bundle_context_manager, bundle_input)
            finally:
                name = clock.stage_name(bundle_context_manager.stage)
                clock.seconds[name] += time.perf_counter() - start
                clock.bundles[name] += 1
                clock.rss_mb[name] = max(clock.rss_mb[name], proc_rss_mb() or 0.0)

        setattr(fn_runner.FnApiRunner, "_execute_bundle", timed)  # noqa: B010  (measurement only)

    @staticmethod
    def stage_name(stage: Any) -> str:
        names: list[str] = []
        for transform in stage.transforms:
            top = transform.unique_name.split("/")[0]
            if top and not top.startswith("ref_") and top not in names:
                names.append(top)
        return "+".join(names) or stage.name


def run_beamflow(config: dict[str, Any], no_state_cache: bool) -> dict[str, Any]:
    from apache_beam.metrics.metric import MetricsFilter

    import pipelines.clicks as clicks

    if no_state_cache:
        # The proposed runners/direct.py change, applied here only: FnApiRunner's in-process SDK worker builds its
        # StateCache from this module constant; 0 disables the cache (reads go straight to the in-memory state).
        from apache_beam.runners.portability.fn_api_runner import worker_handlers

        worker_handlers.STATE_CACHE_SIZE_MB = 0
    stages = StageClock()
    stages.install()
    start = time.perf_counter()
    result = clicks.run_with_config(config)
    seconds = time.perf_counter() - start
    metrics = result.metrics().query(MetricsFilter().with_name("records_read"))["counters"]
    # A run split over processes: their stages ran there (the stage clock sees none), their memory is added.
    parts = getattr(result, "outcomes", [])
    return {
        "processes": max(len(parts), 1),
        "seconds": seconds,
        "records": sum(r.committed or 0 for r in metrics),
        # Which job module ran (it may change between the variants of one run while others edit it).
        "code": _code_digest([clicks.__file__]),
        "stages": dict(stages.seconds),
        "bundles": dict(stages.bundles),
        "stage_rss_mb": dict(stages.rss_mb),
        **_usage(sum(p.peak_rss_mb for p in parts)),
    }


def run_flink(config: dict[str, Any]) -> dict[str, Any]:
    """The clicks job on the Flink session cluster; the LOOPBACK SDK workers run in this process."""
    from apache_beam.metrics.metric import MetricsFilter

    import pipelines.clicks as clicks
    from beamflow.flink_rest import FlinkRest

    rest_url = config.pop("_rest_url")  # the parent's note for this function, not a key of the job's config
    called = time.time()
    start = time.perf_counter()
    result = clicks.run_with_config(config, runner="FlinkRunner")
    seconds = time.perf_counter() - start
    returned = time.time()
    out: dict[str, Any] = {"seconds": seconds, "state": str(result.state)}
    try:
        counters = result.metrics().query(MetricsFilter().with_name("records_read"))["counters"]
        out["records"] = sum((r.committed or r.attempted or 0) for r in counters)
    except Exception as exc:  # the job server's metrics are best effort; the audit checks the data anyway
        out["metrics_error"] = f"{type(exc).__name__}: {exc}"
    rest = FlinkRest(rest_url)
    [job] = [j for j in rest.jobs() if j.name == config["flink"]["job_name"]]
    detail = rest.job(job.job_id)
    start_ms, end_ms = int(detail["start-time"]), int(detail["end-time"])
    timestamps = {k: int(v) for k, v in (detail.get("timestamps") or {}).items() if int(v) > 0}
    reasons: list[str] = []
    try:
        entries = rest.failure_history(job.job_id)
        for entry in entries:
            first = (str(entry.get("stacktrace") or entry.get("exceptionName") or "").strip().splitlines() or [""])[0]
            reasons.append(f"{str(entry.get('taskName') or '')[:80]}: {first[:300]}")
        failures = len(entries)
    except Exception:
        failures = -1
    out.update(
        job_id=job.job_id,
        flink_state=detail["state"],
        job_s=(end_ms - start_ms) / 1000,
        # CREATED -> RUNNING is scheduling and deploying the tasks (and waiting for slots).
        running_s=(end_ms - timestamps.get("RUNNING", start_ms)) / 1000,
        submit_s=start_ms / 1000 - called,
        after_s=returned - end_ms / 1000,
        restarted="RESTARTING" in timestamps,
        failures=failures,
        failure_reasons=reasons,
        vertices=[
            {
                "name": v.get("name", "")[:200],
                "parallelism": v.get("parallelism"),
                "duration_s": int(v.get("duration", 0)) / 1000,
                "read_records": (v.get("metrics") or {}).get("read-records"),
                "write_records": (v.get("metrics") or {}).get("write-records"),
            }
            for v in detail.get("vertices", [])
        ],
        code=_code_digest([clicks.__file__]),
        **_usage(),
    )
    return out


def _code_digest(paths: list[str | None]) -> str:
    import hashlib

    digest = hashlib.sha1(usedforsecurity=False)
    for path in paths:
        if path:
            digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:10]


def use_committed(paths: tuple[str, ...] = HEAD_FILES) -> None:
    """Imports the git HEAD version of each module file (or package folder) in place of the working tree's, before
    anything imports it."""
    import importlib
    import importlib.abc
    import importlib.util
    import types

    repo = Path(__file__).resolve().parents[2]

    def head(path: str) -> str:
        return subprocess.run(
            ["git", "show", f"HEAD:{path}"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout

    packages = [path.rstrip("/") for path in paths if not path.endswith(".py")]
    if packages:

        class _HeadSources(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            """Serves the modules of a package folder from git HEAD (its submodules import each other)."""

            def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
                for package in packages:
                    prefix = package.replace("/", ".")
                    if name == prefix or name.startswith(prefix + "."):
                        is_package = name == prefix
                        file = package + (
                            "/__init__.py" if is_package else name[len(prefix) :].replace(".", "/") + ".py"
                        )
                        return importlib.util.spec_from_loader(name, self, origin=file, is_package=is_package)
                return None

            def create_module(self, spec: Any) -> None:
                return None

            def exec_module(self, module: types.ModuleType) -> None:
                file = str(module.__spec__.origin)  # type: ignore[union-attr]
                module.__file__ = str(repo / file)
                exec(compile(head(file), f"HEAD:{file}", "exec"), module.__dict__)  # measurement only

        sys.meta_path.insert(0, _HeadSources())
    for path in paths:
        if not path.endswith(".py"):
            continue
        source = head(path)
        name = path.removesuffix(".py").replace("/", ".")
        module = types.ModuleType(name)
        module.__file__ = str(repo / path)
        sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
        exec(compile(source, f"HEAD:{path}", "exec"), module.__dict__)  # measurement only
        package, _, leaf = name.rpartition(".")
        if package:
            setattr(importlib.import_module(package), leaf, module)


def _child(variant: str, config_path: str) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, force=True)
    config = json.loads(Path(config_path).read_text())
    if variant == "beamflow-head":
        use_committed()
    if variant == "baseline":
        from benchmarks.e2e.baseline import run_baseline

        out = run_baseline(config)
    elif variant == "flink":
        out = run_flink(config)
    else:
        out = run_beamflow(config, no_state_cache=variant == "beamflow-nocache")
    print("RESULT " + json.dumps(out), flush=True)
