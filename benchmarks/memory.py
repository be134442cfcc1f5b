"""A process's own peak memory, for benchmark children to report (no dependencies: the Quix job imports it too).

Why not ``getrusage(...).ru_maxrss``: Linux carries the largest RSS across ``execve``, and Python starts children
with ``vfork``, so a child's ``ru_maxrss`` (and ``wait4``'s rusage of it) is at least its parent's RSS at the start.
The benchmark parents hold the generated traffic in memory, so that figure grew with the input whatever the child
did (a child using 10 MB reported its 611 MB parent's figure). ``VmHWM`` is the high-water mark of the process's own
memory since its ``execve``.
"""

from __future__ import annotations

__all__ = ["own_peak_rss_mb"]


def own_peak_rss_mb() -> float:
    """This process's peak resident memory in MB since it started (``VmHWM`` of ``/proc/self/status``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line (not Linux?)")
