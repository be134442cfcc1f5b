"""Event ids are deterministic across processes and hash seeds, and distinguish what they should."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to
from hypothesis import given, settings
from hypothesis import strategies as st

from beamflow.event_id import event_id_from_coordinates, event_id_from_fields
from runners.direct import local_options
from transforms.attach_event_id import AttachEventId

pytestmark = pytest.mark.unit

_PROBE = (
    "from beamflow.event_id import event_id_from_coordinates as c, event_id_from_fields as f;"
    "print(c('clicks', 3, 12345), f({'user_id': 'u1', 'ad_id': 7, 'ts': 1.0}, ['user_id', 'ad_id', 'ts']))"
)


def test_ids_are_identical_across_processes_with_different_hash_seeds() -> None:
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outputs.add(
            subprocess.run(
                [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
            ).stdout.strip()
        )
    assert len(outputs) == 1
    here = f"{event_id_from_coordinates('clicks', 3, 12345)} " + event_id_from_fields(
        {"user_id": "u1", "ad_id": 7, "ts": 1.0}, ["user_id", "ad_id", "ts"]
    )
    assert outputs == {here}


def test_ids_are_uuid_strings_and_distinguish_coordinates_and_fields() -> None:
    a = event_id_from_coordinates("t", 0, 1)
    assert len(a) == 36 and a.count("-") == 4
    assert a != event_id_from_coordinates("t", 1, 0)
    assert a != event_id_from_coordinates("t0", 0, 1)
    assert event_id_from_fields({"x": 1, "y": "a"}, ["x", "y"]) != event_id_from_fields({"x": 1, "y": "b"}, ["x", "y"])
    # Field order is part of the definition; 1 and 1.0 are the same value.
    assert event_id_from_fields({"x": 1}, ["x"]) == event_id_from_fields({"x": 1.0}, ["x"])
    with pytest.raises(KeyError, match="missing"):
        event_id_from_fields({"x": 1}, ["x", "y"])


def test_attach_event_id_transform() -> None:
    rows: list[dict[str, Any]] = [{"topic": "t", "partition": 0, "offset": i} for i in range(3)]
    expected = [{**r, "event_id": event_id_from_coordinates("t", 0, r["offset"])} for r in rows]
    with beam.Pipeline(options=local_options()) as p:
        result = p | beam.Create(rows) | AttachEventId()
        assert_that(result.events, equal_to(expected))
        assert_that(result.dead_letters, equal_to([]), label="no dead letters")


def test_attach_event_id_sends_an_event_missing_an_identifying_field_to_dead_letters() -> None:
    fields = ["user_id", "ad_id"]
    rows: list[Any] = [
        {"user_id": "u1", "ad_id": "a1"},
        {"user_id": "u2", "_kafka": {"topic": "clicks", "partition": 1, "offset": 7}},  # no ad_id
        "not a mapping",
    ]
    with beam.Pipeline(options=local_options()) as p:
        result = p | beam.Create(rows) | AttachEventId(fields=fields)
        assert_that(result.events, equal_to([{**rows[0], "event_id": event_id_from_fields(rows[0], fields)}]))
        dead = result.dead_letters | beam.Map(lambda d: (d.stage, d.error, d.topic, d.partition, d.offset, d.reason))
        assert_that(
            dead,
            equal_to(
                [
                    ("attach_event_id", "MissingField", "clicks", 1, 7, "event id fields missing from record: ad_id"),
                    (
                        "attach_event_id",
                        "MissingField",
                        None,
                        None,
                        None,
                        "event id fields missing from record: user_id, ad_id",
                    ),
                ]
            ),
            label="dead letters",
        )
    # Without fields: the Kafka coordinates; a row without them is a dead letter too.
    with beam.Pipeline(options=local_options()) as p:
        result = p | beam.Create([{"topic": "t", "partition": 0}]) | AttachEventId()
        reasons = result.dead_letters | beam.Map(lambda d: d.reason)
        assert_that(reasons, equal_to(["no Kafka coordinates in element to derive an event id from: missing 'offset'"]))


def test_ids_are_pinned_across_releases() -> None:
    # Ids live in the sinks' tables across runs and upgrades (the first-copy table, Iceberg's event_id): a release
    # that derives another id for the same event would let its next run take every replayed event for a new one.
    # These values were computed by the first release's code (uuid.UUID over BLAKE2b, json.dumps per call).
    assert event_id_from_coordinates("clicks", 3, 12345) == "9c981e1c-80d9-2aca-8343-5dbe9c9a9fb7"
    assert event_id_from_coordinates("t", 0, 0) == "e79a67c1-7e63-e915-d5ae-68eea4bfa72c"
    assert (
        event_id_from_fields({"user_id": "u1", "ad_id": 7, "ts": 1.0}, ["user_id", "ad_id", "ts"])
        == "dad5d120-0379-d4b5-7a8f-c1da805021ed"
    )
    awkward = {
        "a": 'ünï "q" \\',
        "b": True,
        "c": None,
        "d": b"\x00\xff",
        "e": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        "f": 2.5,
        "g": -3,
        "h": 10**20,
    }
    assert event_id_from_fields(awkward, list("abcdefgh")) == "a1d3151b-ad0a-7c0d-fa89-3879fcef6322"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(max_size=12), st.one_of(st.text(), st.integers(), st.booleans(), st.floats())), max_size=5
    )
)
def test_written_out_json_is_the_encoders_text(pairs: list[tuple[str, Any]]) -> None:
    # The str/int fast path of event_id_from_fields against the JSON encoder it stands in for (any text: quotes,
    # backslashes, control characters, non-ASCII, surrogates; big and negative ints; other types fall back).
    from beamflow.event_id import _COMPACT_JSON, _canonical, _compact_json

    record = dict(pairs)
    fields = list(record)
    assert _compact_json(record, fields) == _COMPACT_JSON.encode([[f, _canonical(record[f])] for f in fields])
