"""Dependencies point one way: the engines (``beamflow/``) never import the jobs (``pipelines/``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def imports_of_jobs(source: str, filename: str = "<source>") -> list[str]:
    """Every ``import pipelines...`` / ``from pipelines... import`` in ``source``, at any depth (functions included)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{filename}:{node.lineno} {name}" for name in names if name.split(".")[0] == "pipelines"]
    return found


def test_no_engine_module_imports_a_job() -> None:
    offenders = [
        hit
        for path in sorted((ROOT / "beamflow").rglob("*.py"))
        for hit in imports_of_jobs(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert offenders == []


def test_the_check_sees_imports_inside_functions() -> None:
    # What beamflow/demo.py did before the demo moved to pipelines/clicks_demo.py.
    source = "def run():\n    import pipelines.clicks as clicks\n    from pipelines.clicks import first_copies_table\n"
    assert len(imports_of_jobs(source)) == 2
    assert imports_of_jobs("import pipelinesque\nfrom beamflow import config\n") == []
