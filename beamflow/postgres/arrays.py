"""Array parameters as PostgreSQL array literals, built with ``str.join`` instead of psycopg's per-element dumper.

Why: the stores send a bundle's worth of keys and Kafka coordinates as arrays (``unnest(%s::bigint[])``,
``= ANY(%s)``). psycopg dumps a Python list element by element in Python (``ListDumper._dump_list``): about 0.7 us
per element, profiled at a tenth of the clicks job's CPU on the local runner (the first-copy claims and the sessions
ledger send five arrays per event between them). ``",".join(map(str, ints))`` does the same in C, 5x faster; text
elements need one quoting step each, 3x faster. The server parses the literal exactly as it parses psycopg's text
array, so the statements do not change: pass the literal where the list went, keeping the explicit cast
(``%s::bigint[]``), because a Python str goes out untyped and the cast gives it its type.

Only for ints and strs: other element types keep psycopg's dumpers (their text forms have rules of their own).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["int_array", "text_array"]


def int_array(values: Iterable[int]) -> str:
    """``'{1,2,3}'``: an array literal of Python ints (``bool`` and other types are refused, not coerced)."""
    items = values if isinstance(values, list | tuple) else list(values)
    for v in items:
        if type(v) is not int:
            raise TypeError(f"int_array takes ints, got {type(v).__name__}: {v!r}")
    return "{" + ",".join(map(str, items)) + "}"


def _quoted(value: str | None) -> str:
    if value is None:
        return "NULL"
    if type(value) is not str:
        raise TypeError(f"text_array takes strs or None, got {type(value).__name__}: {value!r}")
    # Inside double quotes only the backslash and the double quote are special; the quotes keep NULL, braces, commas
    # and blanks literal.
    if "\\" in value or '"' in value:
        value = value.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + value + '"'


def text_array(values: Iterable[str | None]) -> str:
    """``'{"a","b"}'``: an array literal of Python strs, each quoted; ``None`` becomes SQL NULL."""
    return "{" + ",".join(map(_quoted, values)) + "}"
