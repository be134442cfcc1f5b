"""The whole suite as two pytest processes side by side: the Flink tier and everything else (``./run test``).

Why: the Flink tier (about 16 of the suite's 28-30 minutes run alone) mostly waits, on paced traffic, on failovers and
on checkpoints, while the other tier computes. Run one after the other, the suite took 27.5-31 minutes on CI's 2
cores, over the budget. Side by side they share the cores, and the Flink tier's drills run on a busy machine, which
is the shape users deploy in anyway.

Each tier runs against its own set of real services (its own data folder: ``BEAMFLOW_TEST_DATA``), so neither can
see the other's topics, tables or restarts. They share the download cache; installs take turns across processes
(``install_lock``). The other tier's output streams live; the Flink tier's is written to a log file and printed whole
when both are done, so the two never interleave. The exit status is non-zero when either tier failed.

``python tests/tiers.py [pytest args]`` passes the arguments to both tiers; ``./run test ARGS`` with arguments runs a
single pytest process instead (a selection is usually one tier anyway).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("other", "flink")


@dataclass
class TierRun:
    tier: str
    process: subprocess.Popen[bytes]
    started: float
    log: Path | None
    seconds: float = 0.0
    rc: int | None = None


def tier_command(tier: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", f"--tier={tier}", *args]


def tier_env(tier: str, base: dict[str, str]) -> dict[str, str]:
    """The tier's environment: its own services' data folder (under the one the caller chose, if any)."""
    data = Path(base.get("BEAMFLOW_TEST_DATA", ROOT / ".data" / "test"))
    return {**base, "BEAMFLOW_TEST_DATA": str(data if tier == "other" else data.with_name(f"{data.name}-{tier}"))}


def start(tier: str, args: list[str], log: Path | None) -> TierRun:
    out = log.open("wb") if log else None
    try:
        process = subprocess.Popen(
            tier_command(tier, args),
            cwd=ROOT,
            env=tier_env(tier, dict(os.environ)),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
    finally:
        if out:
            out.close()  # the child holds its own descriptor
    return TierRun(tier, process, time.monotonic(), log)


def finish(run: TierRun) -> TierRun:
    run.rc = run.process.wait()
    run.seconds = time.monotonic() - run.started
    return run


def _stop_on_sigterm(runs: list[TierRun]) -> None:
    """A SIGTERM (CI's timeout, ``kill``) reaches this process only: each tier gets a SIGINT, on which pytest tears
    its session down and stops its services. A terminal's Ctrl-C already reaches both tiers (same process group), so
    this process then only waits for them to finish their teardown."""

    def stop(signum: int, _frame: object) -> None:
        for run in runs:
            if run.process.poll() is None:
                run.process.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(args: list[str]) -> int:
    logs = ROOT / ".data" / "test-logs"
    logs.mkdir(parents=True, exist_ok=True)
    # The Flink tier starts first: its services take longest to get ready on a fresh machine.
    flink = start("flink", args, logs / "flink-tier.log")
    print(f"[tiers] the Flink tier runs beside this one; its output: {flink.log} (printed when it ends)", flush=True)
    other = start("other", args, None)
    _stop_on_sigterm([flink, other])  # after both started: an ignored SIGINT would be inherited by them
    finish(other)
    if flink.process.poll() is None:
        print("[tiers] the other tier is done; waiting for the Flink tier", flush=True)
    finish(flink)
    assert flink.log is not None
    sys.stdout.write(f"\n[tiers] ===== the Flink tier's output ({flink.log}) =====\n")
    sys.stdout.flush()
    sys.stdout.buffer.write(flink.log.read_bytes())
    for run in (other, flink):
        print(f"[tiers] {run.tier} tier: exit status {run.rc} after {run.seconds:.0f} s", flush=True)
    # pytest's exit status 5 is "no tests collected": a selection (-k, -m) may leave one tier empty.
    codes = [run.rc or 0 for run in (other, flink)]
    failed = [code for code in codes if code not in (0, 5)]
    if failed:
        return failed[0]
    return 5 if codes == [5, 5] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
