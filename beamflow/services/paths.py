"""Where beamflow keeps downloads (cache) and service data: ignored folders in the project, overridable."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "data_dir", "project_root"]


def project_root() -> Path:
    """The checkout holding pyproject.toml, else the current directory (an installed beamflow)."""
    env = os.environ.get("BEAMFLOW_HOME")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parents[2]
    if (here / "pyproject.toml").exists():
        return here
    return Path.cwd()


def cache_dir() -> Path:
    return Path(os.environ.get("BEAMFLOW_CACHE", project_root() / ".cache")).resolve()


def data_dir() -> Path:
    return Path(os.environ.get("BEAMFLOW_DATA", project_root() / ".data")).resolve()
