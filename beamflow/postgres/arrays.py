"""Array parameters as PostgreSQL array literals, built with ``str.join`` instead of psycopg's per-element dumper.

Why: the stores send a bundle's worth of keys and Kafka coordinates as arrays (``unnest(%s::bigint[])``,
``= ANY(%s)``). psycopg dumps a Python list element by element in Python (``ListDumper._dump_list``): about 0.7 us
per element, profiled at a tenth of the clicks job's CPU on the local runner (the first-copy claims and the sessions
ledger send five arrays per event between them). ``",".join(map(str, ints))`` does the same in C, 5x faster; text
elements need one quoting step each, 3x faster. The server parses the literal exactly as it parses psycopg's text
array, so the statements do not change: pass the literal where the list went, keeping the explicit cast
(``%s::bigint[]``), because a Python str goes out untyped and the cast gives it its type.

Ints, strs, booleans and aware datetimes (``timestamptz``; the sessions store sends a bundle's session bounds and
event times as arrays too, and psycopg's datetime dumper was its last per-element cost in the profile); other element
types keep psycopg's dumpers. ``array_literal`` picks by the SQL element type.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["array_literal", "bool_array", "int_array", "text_array", "timestamptz_array"]


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


def _timestamp(value: dt.datetime | None) -> str:
    if value is None:
        return "NULL"
    if type(value) is not dt.datetime or value.tzinfo is None or value.utcoffset() is None:
        # A naive datetime would be read in the server session's time zone: refused rather than guessed.
        raise TypeError(f"timestamptz_array takes aware datetimes or None, got {value!r}")
    return '"' + str(value) + '"'  # "2026-12-05 05:00:00.123456+00:00": ISO 8601, read exactly by the server


def timestamptz_array(values: Iterable[dt.datetime | None]) -> str:
    """``'{"2026-12-05 05:00:00.123456+00:00",NULL}'``: aware datetimes to microseconds; ``None`` is SQL NULL."""
    return "{" + ",".join(map(_timestamp, values)) + "}"


def _boolean(value: bool | None) -> str:
    if value is None:
        return "NULL"
    if type(value) is not bool:
        raise TypeError(f"bool_array takes bools or None, got {type(value).__name__}: {value!r}")
    return "t" if value else "f"


def bool_array(values: Iterable[bool | None]) -> str:
    """``'{t,f,NULL}'``."""
    return "{" + ",".join(map(_boolean, values)) + "}"


_BY_TYPE: dict[str, Callable[[Iterable[Any]], str]] = {
    "text": text_array,
    "bigint": int_array,
    "integer": int_array,
    "timestamptz": timestamptz_array,
    "boolean": bool_array,
}


def array_literal(values: Sequence[Any], element_type: str) -> str:
    """The literal of ``values`` as an array of ``element_type`` (``text``, ``bigint``, ``integer``, ``timestamptz``,
    ``boolean``); send it with the cast ``%s::<element_type>[]``. Ints are not nullable here (``int_array``)."""
    try:
        build = _BY_TYPE[element_type]
    except KeyError:
        raise ValueError(f"no array literal for {element_type!r}; known: {', '.join(_BY_TYPE)}") from None
    return build(values)
