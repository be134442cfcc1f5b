"""The figure in docs/benchmarks.md: throughput per variant and stage, and consumer lag over time during the e2e run.

Fed by ``benchmarks.e2e --json`` (and optionally ``benchmarks.kafka_read --json``); see docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["plot"]


def _short(stage: str, keep: int = 3) -> str:
    """A fused stage named by its first few transforms (the full names are in the e2e output)."""
    parts = stage.split("+")
    return "+".join(parts[:keep]) + (f" +{len(parts) - keep} more" if len(parts) > keep else "")


def plot(e2e: dict[str, Any], kafka: dict[str, Any] | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: dict[str, dict[str, Any]] = e2e["results"]
    fig = plt.figure(figsize=(14, 10))
    grid = fig.add_gridspec(2, 2 if kafka else 1, height_ratios=(1.1, 1))
    axes = [fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0])]
    if kafka:
        axes.append(fig.add_subplot(grid[1, 1]))

    # 1. Whole-job records/s per variant, and per stage of the beamflow variants (records / stage seconds).
    ax = axes[0]
    labels, values, colors = [], [], []
    for variant, r in results.items():
        labels.append(f"{variant} (whole job)")
        values.append(r["records"] / r["seconds"])
        colors.append("tab:gray" if variant == "baseline" else "tab:blue")
    best = max(
        (v for v in results if v != "baseline"),
        key=lambda v: results[v]["records"] / results[v]["seconds"],
        default=None,
    )
    if best is not None:
        stages = sorted(results[best].get("stages", {}).items(), key=lambda kv: -kv[1])[:8]
        for stage, seconds in stages:
            if seconds > 0:
                labels.append(f"{best}: {_short(stage)}")
                values.append(results[best]["records"] / seconds)
                colors.append("tab:orange")
    ypos = range(len(labels))
    ax.barh(list(ypos), values, color=colors)
    ax.set_yticks(list(ypos), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("records/s (log scale)")
    ax.set_title(f"clicks job, {e2e['records']:,} records: job and stage throughput", fontsize=10)
    for y, v in zip(ypos, values, strict=True):
        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=7)

    # 2. Consumer lag (end offsets - committed group offsets) over time for each beamflow variant.
    ax = axes[1]
    for variant, r in results.items():
        if r.get("lag"):
            xs, ys = zip(*r["lag"], strict=True)
            ax.plot(xs, ys, label=f"{variant} ({r['seconds']:.0f}s job)", drawstyle="steps-post")
    ax.set_xlabel("seconds since the job's subprocess started")
    ax.set_ylabel("consumer lag (records not yet committed)")
    ax.set_title("lag during the e2e run (sampled every 0.5 s)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    # 3. Kafka read: bare consumer loop vs ReadFromKafka per backend.
    if kafka:
        ax = axes[2]
        rows = kafka["results"]
        names = [r["backend"] for r in rows]
        pos = list(range(len(names)))
        width = 0.27
        series = [
            ("bare", "bare consumer loop"),
            ("transform", "ReadFromKafka, whole run"),
            ("steady", "ReadFromKafka, steady state"),
        ]
        for i, (key, label) in enumerate(series):
            if all(key in r for r in rows):
                bar_x = [x + (i - 1) * width for x in pos]
                ax.bar(bar_x, [r[key] for r in rows], width, label=label)
                if key != "bare":
                    for x, r in zip(bar_x, rows, strict=True):
                        ax.text(x, r[key], f"{r[key] / r['bare']:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(pos), names)
        ax.set_ylabel("msg/s")
        ax.set_title(f"Kafka read, {kafka['records']:,} records x {kafka['partitions']} partitions", fontsize=10)
        ax.legend(fontsize=8)

    load = e2e.get("load") or [0]
    fig.suptitle(f"beamflow benchmarks (nproc={e2e.get('nproc')}, load average {load[0]:.1f} at start)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
