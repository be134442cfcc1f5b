"""The printed report: the table of variants against the baseline, the Flink breakdown, stages, audit problems."""

from __future__ import annotations

from typing import Any

from benchmarks.e2e.settings import GOAL


def print_report(results: dict[str, dict[str, Any]], base: dict[str, Any], problems: dict[str, list[str]]) -> None:
    """Prints the figures of every variant (its fastest run) with ratios to the baseline, then any audit problem."""
    base_r = results.get("baseline")
    print(
        f"\n{'variant':22} {'wall s':>7} {'rec/s':>8} {'CPU s':>7} {'rec/CPU s':>10} {'peak MB':>8} "
        f"{'x rec/s':>8} {'x rec/CPU':>9} {'x mem':>6}"
    )
    for variant, r in results.items():
        if variant != "flink":
            _row(variant, r["records"], r["seconds"], r["cpu_s"], r["peak_rss_mb"], base_r)
            continue
        jvm_cpu = sum(v for v in (r.get("jvm_cpu_s") or {}).values() if v)
        _row("flink (total wall)", r["records"], r["seconds"], r["cpu_s"] + jvm_cpu, r["peak_rss_mb"], base_r)
        _row("flink (job run)", r["records"], r["job_s"], None, None, base_r)
    print(f"(goal: beamflow >= {GOAL}x the baseline's records/s; 'x mem' is peak RSS relative to the baseline)")
    if "flink" in results:
        r = results["flink"]
        cpu = r.get("jvm_cpu_s") or {}
        print(
            f"\nflink: job {r['job_id']} {r['flink_state']}, "
            + ("streaming" if base["flink"].get("streaming") else "batch (streaming: false)")
            + f", parallelism "
            f"{base['flink']['parallelism']}, LOOPBACK SDK workers in the submitting process; restarted: "
            f"{r['restarted']}, failures in Flink's exception history: {r['failures']}\n"
            f"  total wall {r['seconds']:.1f}s (run_with_config) = submission {r['submit_s']:.1f}s (call -> Flink "
            f"start-time: pipeline construction, job server translation, upload of the staged jars)\n"
            f"    + job run {r['job_s']:.1f}s (Flink start-time -> end-time from REST; {r['running_s']:.1f}s of it "
            f"RUNNING since it last entered that state) + {r['after_s']:.1f}s (end-time -> run_with_config returned)\n"
            f"  records/s: {r['records'] / r['job_s']:,.0f} over the job run, {r['records'] / r['seconds']:,.0f} "
            f"over the total wall"
            + (
                f" ({r['records'] / r['job_s'] / _rate(base_r):.2f}x and "
                f"{r['records'] / r['seconds'] / _rate(base_r):.2f}x the baseline's)"
                if base_r
                else ""
            )
            + f"\n  CPU s: submitting process {r['cpu_s']:.1f} (LOOPBACK Python workers included), "
            + ", ".join(f"{role} {v:.1f}" if v is not None else f"{role} ?" for role, v in cpu.items())
            + " (JVM deltas over the variant's whole run; 'CPU s' of the total-wall row is their sum)\n"
            f"  memory: peak RSS of the submitting process {r['peak_rss_mb']:.0f} MB (the Flink JVMs are NOT in it); "
            f"TaskManager JVM peak RSS {r.get('tm_peak_rss_mb', 0):.0f} MB, peak heap used "
            f"{r.get('tm_peak_heap_mb', 0):.0f} MB (sampled every 0.5 s)"
        )
        tasks = sum(int(v["parallelism"] or 0) for v in r["vertices"])
        print(f"  {len(r['vertices'])} Flink vertices, {tasks} tasks (per vertex: durations and records in the JSON)")
        if r["restarted"] or r["failures"]:
            print(
                f"  WARNING: the Flink job failed over during the run ({r['failures']} failure(s) in its exception "
                f"history): its job run time includes the failed attempt and the restart; see {r['job_id']}'s "
                "exceptions in Flink REST"
            )
            for reason in r.get("failure_reasons", []):
                print(f"    {reason}")
    for variant, r in results.items():
        if "stages" in r:
            print(f"\nwall seconds per fused stage ({variant}, job {r['seconds']:.1f}s; RSS MB as its bundles ended):")
            rss = r.get("stage_rss_mb", {})
            for stage, seconds in sorted(r["stages"].items(), key=lambda kv: -kv[1])[:10]:
                rate = r["records"] / seconds if seconds else 0
                bundles, mb = r["bundles"][stage], rss.get(stage, 0)
                print(f"  {seconds:7.2f}s {rate:>10,.0f} rec/s {bundles:>4} bundles {mb:6.0f} MB  {stage[:80]}")

    for name, found in problems.items():
        print(f"AUDIT PROBLEM ({name}): {'; '.join(found)}")
    if not problems:
        print("\naudit: every variant's sinks hold every record exactly where it belongs; offsets committed to the end")


def _rate(r: dict[str, Any] | None) -> float:
    return r["records"] / r["seconds"] if r else 0.0


def _row(
    label: str, records: int, seconds: float, cpu_s: float | None, rss_mb: float | None, base: dict[str, Any] | None
) -> None:
    """One line of the table; CPU and memory columns left empty when not given (the Flink job-run row)."""
    rate = records / seconds
    cpu_rate = records / max(cpu_s, 1e-9) if cpu_s is not None else None
    cells = [f"{label:22} {seconds:7.1f} {rate:8,.0f}"]
    cells.append(
        f"{cpu_s:7.1f} {cpu_rate:10,.0f}" if cpu_s is not None and cpu_rate is not None else f"{'-':>7} {'-':>10}"
    )
    cells.append(f"{rss_mb:8.0f}" if rss_mb is not None else f"{'-':>8}")
    if base:
        b_cpu = base["records"] / max(base["cpu_s"], 1e-9)
        cells.append(f"{rate / _rate(base):8.2f}")
        cells.append(f"{cpu_rate / b_cpu:9.2f}" if cpu_rate is not None else f"{'-':>9}")
        cells.append(f"{rss_mb / base['peak_rss_mb']:6.2f}" if rss_mb is not None else f"{'-':>6}")
    print(" ".join(cells))
