"""What the jobs' demos share: starting the services a conf names, dropping a demo's topics and tables so a rerun's
summary is exact, the summary table's layout, and what the demo leaves running with the command that stops it."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from beamflow.config import JobConfig, auto_services
from beamflow.services import ServiceSet

__all__ = ["address", "drop_tables", "drop_topics", "left_behind", "start_needed", "stop_command", "table"]


def start_needed(config: JobConfig, services: ServiceSet, progress: Callable[[str], None]) -> list[str]:
    """Starts the local services the config's ``auto`` endpoints name (running ones are left alone); their names."""
    needed = auto_services(config)
    progress(f"starting services: {', '.join(needed) or 'none'} (first run downloads and builds them)")
    for name in needed:
        t0 = time.monotonic()
        services.get(name).up()
        progress(f"  {name} up ({time.monotonic() - t0:.1f}s)")
    return needed


def drop_topics(bootstrap: str, topics: Iterable[str]) -> None:
    """Deletes the topics that exist and waits until the broker has let go of their names."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = [t for t in topics if t in admin.list_topics(timeout=10).topics]
    if not existing:
        return
    for future in admin.delete_topics(existing).values():
        future.result(30)
    # Deletion is asynchronous in the broker; wait until the names are free.
    deadline = time.monotonic() + 30
    while set(existing) & set(admin.list_topics(timeout=10).topics) and time.monotonic() < deadline:
        time.sleep(0.5)


def drop_tables(dsn: str, tables: Iterable[str]) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in tables:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))


def table(rows: Sequence[tuple[str, str]]) -> str:
    """The summary: names left, values right, between two rules."""
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v:>12}" for k, v in rows]
    rule = "-" * (width + 14)
    return "\n".join([rule, *lines, rule])


def stop_command(services: ServiceSet, names: list[str]) -> str:
    """The command that stops ``names`` under ``services.data``, as this user can type it here."""
    exe = Path(sys.prefix) / "bin" / "beamflow"
    on_path = shutil.which("beamflow")
    command = "beamflow" if on_path and Path(on_path).resolve() == exe.resolve() else os.path.relpath(exe)
    data = f"BEAMFLOW_DATA={services.data} " if os.environ.get("BEAMFLOW_DATA") else ""
    return f"{data}{command} services down {' '.join(names)}"


def address(services: ServiceSet, name: str) -> str:
    state = services.get(name).state()
    info = state.info if state else {}
    return str(info.get("bootstrap") or info.get("url") or info.get("dsn") or (state.ports if state else ""))


def left_behind(left_running: dict[str, str], data_dir: str, stop: str, what: str) -> str:
    """What is still running after a demo, where its data is (``what`` it holds), and the command that stops it."""
    running = ", ".join(f"{name} ({where})" for name, where in left_running.items()) or "nothing"
    return "\n".join([f"still running: {running}", f"data ({what}): {data_dir}", f"stop them with: {stop}"])
