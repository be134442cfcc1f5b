"""Process memory from ``/proc``, one reader for the benchmarks and a local run split over processes (no dependencies:
the benchmarks' Quix job loads it by path too).

Why a child reports its own peak (``own_peak_rss_mb``) rather than ``getrusage(...).ru_maxrss``: Linux carries the
largest RSS across ``execve``, and Python starts children with ``vfork``, so a child's ``ru_maxrss`` (and ``wait4``'s
rusage of it) is at least its parent's RSS at the start. The benchmark parents hold the generated traffic in memory,
so that figure grew with the input whatever the child did (a child using 10 MB reported its 611 MB parent's figure).
``VmHWM`` is the high-water mark of the process's own memory since its ``execve``.
"""

from __future__ import annotations

__all__ = ["glibc_heap_mb", "own_peak_rss_mb", "proc_rss_mb"]


def _status_mb(pid: int | str, field: str) -> float | None:
    """The ``field`` line of ``/proc/<pid>/status`` in MB; None when the process is gone (or has no such line)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def proc_rss_mb(pid: int | str = "self") -> float | None:
    """Resident memory of one process in MB now (``VmRSS``); None when it is gone."""
    return _status_mb(pid, "VmRSS")


def own_peak_rss_mb() -> float:
    """This process's peak resident memory in MB since it started (``VmHWM`` of ``/proc/self/status``)."""
    peak = _status_mb("self", "VmHWM")
    if peak is None:
        raise RuntimeError("/proc/self/status has no VmHWM line (not Linux?)")
    return peak


def glibc_heap_mb() -> dict[str, float]:
    """glibc's own heap in this process (``mallinfo2``), in MB: what the allocator took from the system outside mmap
    (``arena``), what of it is in use (``in_use``) and what it holds free (``free_held``: freed but not returned,
    fragmentation), and its mmapped blocks (``mmapped``). Raises ``OSError`` or ``AttributeError`` without glibc 2.33+.
    """
    import ctypes

    class _MallInfo2(ctypes.Structure):
        # All ten fields: the struct is returned by value, so ctypes must know its whole size.
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                         "fordblks", "keepcost")
        ]  # fmt: skip

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    mb = 2**20
    return {
        "arena": info.arena / mb,
        "in_use": info.uordblks / mb,
        "free_held": info.fordblks / mb,
        "mmapped": info.hblkhd / mb,
    }
