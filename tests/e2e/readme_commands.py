"""The README's commands, read from the README itself: its ``bash`` blocks and the first column of its command tables.

A table cell such as ``beamflow iceberg expire\\|compact TABLE`` becomes one command per alternative, with its
``[optional]`` parts left out (or filled where ``FILL`` says how) and its placeholders replaced by ``VALUES``. A new
README command is run by ``tests/e2e/test_readme_commands.py`` as soon as it is in a table; a new placeholder fails
``test_every_readme_placeholder_has_a_value`` until it is given a value here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# Placeholder -> the value a new user would type here (the demo's table, the shipped schema and conf).
VALUES = {
    "N": "300",
    "TABLE": "beamflow.impressions",
    "S": "clicks-value",
    "F.avsc": "beamflow/avro/schemas/click_v2.avsc",
    "NAME": "postgres",
}
# Optional parts run filled in rather than left out: a service of its own for ``services up|down`` (the default, all
# four, would restart the session's services), and a small demo.
FILL = {"[NAME]": "NAME", "[--events N]": "--events 2000"}
# Commands of the README that this run does not start, and why.
NOT_RUN = {"./run test": "it runs the whole suite, of which this test is part"}
# Commands that need a Flink job on the cluster (run by the flink tier, after submitting the clicks job to it).
FLINK_PREFIXES = ("beamflow flink", "beamflow status", "python -m pipelines.clicks --runner=FlinkRunner")

_PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|[A-Z]\.[a-z]+)$")


@dataclass(frozen=True)
class ReadmeCommand:
    text: str  # as the README writes it
    argv: tuple[str, ...]  # one runnable form

    @property
    def line(self) -> str:
        return " ".join(self.argv)


def written_commands(readme: str | None = None) -> list[str]:
    """Every command as written: lines of ``bash`` blocks, then each table's backticked first-column commands."""
    text = README.read_text() if readme is None else readme
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        out += [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    in_table = False
    for line in text.splitlines():
        cells = re.split(r"(?<!\\)\|", line.strip())[1:-1] if line.strip().startswith("|") else []
        if cells and cells[0].strip() == "command":
            in_table = True
            continue
        if not cells:
            in_table = False
            continue
        if in_table and not set(cells[0].strip()) <= set("-: "):
            out += [c.replace("\\|", "|") for c in re.findall(r"`([^`]+)`", cells[0])]
    return out


def expand(written: str) -> list[ReadmeCommand]:
    """The runnable forms of one written command: each ``a|b`` alternative, optional parts dropped or filled."""
    text = written
    for group, value in FILL.items():
        text = text.replace(group, value)
    text = re.sub(r"\s*\[[^\]]*\]", "", text)
    tokens = [t for t in text.split() if t != "..."]
    forms: list[list[str]] = [[]]
    for token in tokens:
        choices = token.split("|") if "|" in token and not token.startswith("--") else [token]
        forms = [[*form, VALUES.get(choice, choice)] for form in forms for choice in choices]
    return [ReadmeCommand(written, tuple(form)) for form in forms]


def readme_commands(readme: str | None = None) -> list[ReadmeCommand]:
    return [command for written in written_commands(readme) for command in expand(written)]


def placeholders_left(command: ReadmeCommand) -> list[str]:
    return [token for token in command.argv if _PLACEHOLDER.match(token)]
