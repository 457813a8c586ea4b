"""Key schema and the packed stream encoding of step records."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model import keys
from slurm_plugin.model.records import (
    decode_header,
    decode_json_entry,
    decode_steps,
    encode_json_entry,
    encode_steps,
    is_valid_raw,
    non_negative_int,
)


def test_job_keys_share_one_hash_tag() -> None:
    """All keys of a job carry {JOB}, so Redis Cluster puts them in one slot."""
    assert keys.job_keys("123") == [
        "stg:job:{123}:meta",
        "stg:job:{123}:steps",
        "stg:job:{123}:gpu",
        "stg:job:{123}:events",
        "stg:job:{123}:service",
        "stg:job:{123}:advice",
    ]
    assert keys.node("gpu-a17.rack3") == "stg:node:gpu-a17.rack3"
    assert keys.job_steps("123_4") == "stg:job:{123_4}:steps"


@pytest.mark.parametrize(
    "hostile", ["", "12}x", "1 2", "12\n", "{12}", "../1", "1" * 40, "12;DEL", "*"]
)
def test_hostile_job_ids_are_rejected(hostile: str) -> None:
    """A job id that could escape its hash tag or key is refused."""
    with pytest.raises(TelemetryError, match="invalid job id"):
        keys.job_meta(hostile)


@pytest.mark.parametrize("hostile", ["", "node 1", "node\n1", "-x", "a:b", "n{1}", "n*"])
def test_hostile_node_names_are_rejected(hostile: str) -> None:
    """A node name with separators, glob or tag characters is refused."""
    with pytest.raises(TelemetryError, match="invalid node name"):
        keys.node(hostile)


def test_round_trip() -> None:
    """Encoded steps decode to the same values; missing phases stay missing."""
    raws = [(0, 1700000000.123456, 0.25, 0.2, 0.04, None), (1, 1700000000.5, 0.3, None, None, 0.01)]
    fields = encode_steps(5, "node2", 3, 1, raws)
    records = decode_steps("42", fields)
    assert [(r.step, r.rank, r.node, r.gpu, r.attempt) for r in records] == [
        (0, 5, "node2", 3, 1),
        (1, 5, "node2", 3, 1),
    ]
    assert records[0].ts == pytest.approx(1700000000.123456)
    assert (records[0].compute_s, records[0].comm_s, records[0].data_s) == (0.2, 0.04, None)
    assert (records[1].compute_s, records[1].data_s) == (None, 0.01)
    assert "group" not in fields
    assert {r.group for r in records} == {""}
    labelled = decode_steps("42", encode_steps(5, "node2", 3, 1, raws, "pp.stage=3"))
    assert {r.group for r in labelled} == {"pp.stage=3"}


@pytest.mark.parametrize("label", ["a b", "x,y", "", "z" * 65, "stage\n1"])
def test_a_malformed_group_label_is_refused_on_read(label: str) -> None:
    """A group field a job wrote by hand that is not a label is a malformed entry."""
    fields = {"rank": "1", "node": "n", "gpu": "0", "n": "0", "steps": "", "group": label}
    if not label:
        assert decode_steps("1", fields) == []
        return
    with pytest.raises(TelemetryError, match="group label"):
        decode_steps("1", fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"node": "n", "gpu": "0", "n": "0", "steps": ""}, "lacks field 'rank'"),
        (
            {"rank": "x", "node": "n", "gpu": "0", "n": "0", "steps": ""},
            "rank='x' is not an integer",
        ),
        ({"rank": "-1", "node": "n", "gpu": "0", "n": "0", "steps": ""}, "rank=-1 is negative"),
        ({"rank": "1", "node": "n", "gpu": "0", "n": "2", "steps": "0 1 1 - - -"}, "n=2"),
        ({"rank": "1", "node": "n", "gpu": "0", "n": "1", "steps": "0 1 nan - - -"}, "step_s"),
        ({"rank": "1", "node": "n", "gpu": "0", "n": "1", "steps": "0 1 1 -2 - -"}, "compute_s"),
        ({"rank": "1", "node": "n", "gpu": "0", "n": "1", "steps": "0 1 1"}, "3 fields"),
        ({"rank": "1", "node": "n", "gpu": "0", "n": "99999999", "steps": ""}, "max"),
    ],
)
def test_malformed_entries_name_the_problem(fields: dict[str, str], message: str) -> None:
    """Malformed telemetry raises TelemetryError that says what is wrong."""
    with pytest.raises(TelemetryError, match=message):
        decode_steps("1", fields)


@pytest.mark.parametrize("field", ["rank", "gpu", "attempt"])
@pytest.mark.parametrize(
    "text", ["7", "007", "+7", " 7", "7 ", "1_0", "\u0663", "\u00b2", "", "-0"]
)
def test_a_header_number_reads_as_the_checked_reader_reads_it(field: str, text: str) -> None:
    """The header's quick path for plain digits reads every number as the checks do: the
    same value, or the same error."""
    fields = {"rank": "1", "node": "n", "gpu": "0", "attempt": "0", "n": "0", field: text}
    try:
        expected: int | str = non_negative_int(text, field)
    except TelemetryError as exc:
        expected = str(exc)
    try:
        got: int | str = getattr(decode_header(fields), field)
    except TelemetryError as exc:
        got = str(exc)
    assert got == expected


@given(
    st.dictionaries(
        st.sampled_from(["rank", "node", "gpu", "n", "steps", "attempt", "x"]), st.text(max_size=80)
    )
)
def test_decoding_arbitrary_fields_raises_only_telemetry_error(fields: dict[str, str]) -> None:
    """Whatever arrives in the stream, decoding either succeeds or raises TelemetryError."""
    try:
        records = decode_steps("1", fields)
    except TelemetryError:
        return
    for r in records:
        assert math.isfinite(r.step_s)
        assert r.step_s >= 0


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_validity_of_durations(value: float) -> None:
    """A raw step is publishable only with finite, non-negative durations."""
    raw = (1, 1.0, value, None, None, None)
    assert is_valid_raw(raw) == (math.isfinite(value) and value >= 0)


def test_json_entries() -> None:
    """Events round-trip as JSON; non-objects and garbage are rejected."""
    assert decode_json_entry(encode_json_entry({"name": "x", "step": 3})) == {
        "name": "x",
        "step": 3,
    }
    with pytest.raises(TelemetryError):
        decode_json_entry({"json": "[1]"})
    with pytest.raises(TelemetryError):
        decode_json_entry({"json": "{"})
    # Issue 25: a non-finite value, an oversized record and NaN/Infinity constants written
    # by some other client are TelemetryError (refused and counted), never a ValueError.
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(TelemetryError, match="finite"):
            encode_json_entry({"v": bad})
    with pytest.raises(TelemetryError, match="over"):
        encode_json_entry({"v": "x" * 20000})
    for constant in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(TelemetryError, match="not a finite number"):
            decode_json_entry({"json": f'{{"ts": {constant}}}'})


def test_a_json_entry_with_a_number_no_job_reports_is_refused_not_raised() -> None:
    # A job writes its own events: an integer of 400 digits raised OverflowError where the
    # service took it for a time, one of 5,000 ValueError in the parser; either failed the
    # service's whole cycle, for every job, each cycle until the entry expired.
    for text in (
        '{"name": "checkpoint_end", "ts": 1' + "0" * 400 + "}",
        '{"name": "checkpoint_end", "ts": 1' + "0" * 5000 + "}",
        '{"name": "checkpoint_end", "ts": 1e400}',
        '{"name": "x", "step": -' + "9" * 19 + "}",
        '{"name": "x", "d": [1, {"e": 1' + "0" * 30 + "}]}",
    ):
        with pytest.raises(TelemetryError):
            decode_json_entry({"json": text})
    big = '{"step": 999999999999999999, "ts": 1.5e9, "n": -999999999999999999}'
    assert decode_json_entry({"json": big}) == {
        "step": 999999999999999999,
        "ts": 1.5e9,
        "n": -999999999999999999,
    }
