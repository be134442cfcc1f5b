"""Process memory from ``/proc``, one reader for the benchmarks and a local run split over processes (no dependencies:
the benchmarks' Quix job loads it by path too).

Why a child reports its own peak (``own_peak_rss_mb``) rather than ``getrusage(...).ru_maxrss``: Linux carries the
largest RSS across ``execve``, and Python starts children with ``vfork``, so a child's ``ru_maxrss`` (and ``wait4``'s
rusage of it) is at least its parent's RSS at the start. The benchmark parents hold the generated traffic in memory,
so that figure grew with the input whatever the child did (a child using 10 MB reported its 611 MB parent's figure).
``VmHWM`` is the high-water mark of the process's own memory since its ``execve``.

glibc's side (``glibc_heap_mb``, ``release_free_heap``): what the heap holds free, and handing its pages back, which
every streaming worker does once a minute (``release_free_heap_every``, started by every beamflow sink).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

__all__ = [
    "RELEASE_FREE_HEAP_ENV",
    "glibc_heap_mb",
    "own_peak_rss_mb",
    "proc_rss_mb",
    "release_free_heap",
    "release_free_heap_every",
]

# Seconds between two ``release_free_heap`` calls of a streaming worker's releaser; 0 switches it off.
RELEASE_FREE_HEAP_ENV = "BEAMFLOW_RELEASE_FREE_HEAP_S"
_releaser: threading.Thread | None = None
_releaser_lock = threading.Lock()


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


def release_free_heap() -> bool:
    """Hands the pages of glibc's free heap memory back to the system (``malloc_trim(0)``: the top of each arena, and
    the whole free pages inside it, by ``madvise``), so that memory glibc holds free stops counting as resident.

    Why: a streaming worker frees memory between blocks it keeps (fragmentation); glibc returns only the top of an
    arena on its own, so the worker's RSS grows with memory nothing uses (``docs/streaming.md``). A fraction of a
    millisecond on a worker's heap. False where there is no glibc (the call is then a no-op)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.malloc_trim(0))  # ctypes lets go of the GIL for the call
    except (OSError, AttributeError):
        return False


def release_free_heap_every(interval_s: float | None = None) -> threading.Thread | None:
    """Starts this process's releaser, once: a daemon thread calling ``release_free_heap`` every ``interval_s``
    (default: ``$BEAMFLOW_RELEASE_FREE_HEAP_S``, else 60; 0 or less: none). Returns the thread it started, or None
    (switched off, or already running). Every beamflow sink starts it in ``setup``, so each Python worker of a job
    has one."""
    global _releaser
    if interval_s is None:
        interval_s = float(os.environ.get(RELEASE_FREE_HEAP_ENV, "60"))
    if interval_s <= 0:
        return None
    with _releaser_lock:
        if _releaser is not None and _releaser.is_alive():
            return None
        _releaser = threading.Thread(
            target=_release_forever, args=(interval_s,), name="beamflow-release-free-heap", daemon=True
        )
        _releaser.start()
        return _releaser


def _release_forever(interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        release_free_heap()
