"""Every example in the transforms' docstrings and every Python block of README.md runs against the real services.

A snippet is a literal block (a docstring paragraph ending in ``::``) of a module, class or function docstring under
``transforms/``, or a fenced ``python`` block of README.md. Snippets are written for the local services at their
usual addresses; before a snippet runs, the test replaces those strings with this test run's services (the table
``placeholders`` builds below, nothing else) and runs it as a module of its own (Beam pickles the snippet's classes by
module name). Every public PTransform must have at least one snippet.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import apache_beam as beam
import pytest

import transforms
from beamflow.generate import TrafficSpec, avro_click_encoder, generate_traffic, produce_traffic
from beamflow.kafka.admin import create_topic
from beamflow.services import ServiceState

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[2]


def _literal_blocks(docstring: str) -> Iterator[str]:
    """The literal blocks of a docstring: the indented lines after a line ending in ``::``."""
    lines = docstring.expandtabs().splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].rstrip().endswith("::"):
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        block: list[str] = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            block.append(lines[i])
            i += 1
        yield textwrap.dedent("\n".join(block)).strip() + "\n"


def docstring_snippets() -> dict[str, str]:
    """``{module:qualname#n: code}`` for every literal block in the docstrings under transforms/."""
    snippets: dict[str, str] = {}
    for path in sorted((ROOT / "transforms").rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = path.relative_to(ROOT).with_suffix("").as_posix()
        nodes: list[ast.AST] = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef))]
        for node in nodes:
            doc = ast.get_docstring(node, clean=False)  # type: ignore[arg-type]
            name = getattr(node, "name", "module")
            for n, code in enumerate(_literal_blocks(inspect.cleandoc(doc) if doc else "")):
                snippets[f"{where}:{name}#{n}"] = code
    return snippets


def readme_snippets() -> dict[str, str]:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return {f"README.md#{n}": code for n, code in enumerate(blocks)}


SNIPPETS = {**docstring_snippets(), **readme_snippets()}


def test_every_public_transform_has_an_example() -> None:
    public = [name for name in transforms.__all__ if _is_ptransform(getattr(transforms, name))]
    assert len(public) >= 12
    for name in public:
        module = getattr(transforms, name).__module__.replace(".", "/")
        assert any(key.startswith((f"{module}:{name}#", f"{module}:module#")) for key in SNIPPETS), name


def _is_ptransform(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, beam.PTransform)


@pytest.fixture(scope="module")
def example_topic(kafka: ServiceState, registry: ServiceState) -> str:
    """A topic of Avro clicks in the Confluent wire format (a few bad records too), and its dead-letter topic."""
    bootstrap, topic = kafka.info["bootstrap"], f"example-clicks-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 2)
    create_topic(bootstrap, f"{topic}-dlq", 1)
    spec = TrafficSpec(events=60, users=8, partitions=2, idle_partition=None, bad_per_kind=1, seed=16)
    produce_traffic(
        bootstrap, topic, generate_traffic(spec, avro_click_encoder(registry.info["url"], f"{topic}-value"))
    )
    return topic


@pytest.mark.parametrize("key", sorted(SNIPPETS))
def test_snippet_runs(
    key: str, example_topic: str, kafka: ServiceState, postgres: ServiceState, registry: ServiceState
) -> None:
    placeholders = {  # what a snippet says -> this run's service
        '"127.0.0.1:9092"': f'"{kafka.info["bootstrap"]}"',
        '"postgresql://postgres@127.0.0.1:5432/beamflow"': f'"{postgres.info["dsn"]}"',
        '"http://127.0.0.1:8081"': f'"{registry.info["url"]}"',
        '"clicks"': f'"{example_topic}"',
        '"clicks-dlq"': f'"{example_topic}-dlq"',
        '"clicks-job"': f'"example-group-{uuid.uuid4().hex[:8]}"',  # a fresh group: every snippet reads it all
    }
    code = SNIPPETS[key]
    for said, actual in placeholders.items():
        code = code.replace(said, actual)
    name = "snippet_" + re.sub(r"\W", "_", key)
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(code, key, "exec"), module.__dict__)
    finally:
        del sys.modules[name]
