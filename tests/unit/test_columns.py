"""The service's columnar decoding accepts and refuses exactly what the record decoder does,
and yields the same values."""

from __future__ import annotations

import os
from collections.abc import Iterator
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model import columns
from slurm_plugin.model.batch import RecordBatch
from slurm_plugin.model.columns import decode_entries, decode_many
from slurm_plugin.model.records import StepRecord, decode_header, decode_steps, encode_steps
from slurm_plugin.model.relayed import encode_relayed

# Per property and parser; the same STRAGGLER_FUZZ_EXAMPLES as test_fuzz for a longer hunt
# (the unit tier stays under a minute on 2 cores).
PROPERTY = settings(
    max_examples=int(os.environ.get("STRAGGLER_FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_VALUE = st.one_of(
    st.none(), st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
)
_STEP = st.tuples(
    st.integers(0, 10**9),
    st.floats(min_value=0, max_value=2e9, allow_nan=False, allow_infinity=False),
    st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False),
    _VALUE,
    _VALUE,
    _VALUE,
)
_GOOD = st.builds(
    encode_steps,
    st.integers(0, 70_000),
    st.sampled_from(["node1", "node2", "gpu00042"]),
    st.integers(0, 7),
    st.integers(0, 3),
    st.lists(_STEP, min_size=0, max_size=5),
    st.sampled_from(["", "pp=1", "stage3"]),
)
# Tokens an attacker (or a bug) could put in a steps text: numbers in every spelling Python
# reads, and things it does not.
_TOKEN = st.one_of(
    st.sampled_from(
        [
            "0",
            "1",
            "-",
            "-1",
            "-0",
            "1.5",
            "1e3",
            "1e999",
            "nan",
            "inf",
            "1_0",
            "+2",
            "1.2.3",
            ".",
            "e",
            "",
        ]
    ),
    # Every spelling the encoder's alphabet allows ("1.", ".5", "1e-3", "+.e", "--1", ...):
    # the parsers must read exactly what Python's float() reads.
    st.text(alphabet="-+.e0123456789", min_size=1, max_size=6),
)
_TEXT = st.lists(
    st.lists(_TOKEN, min_size=5, max_size=7).map(" ".join), min_size=1, max_size=3
).map("\n".join)


@st.composite
def _flush(draw: st.DrawFn) -> dict[str, str]:
    fields = dict(draw(_GOOD))
    how = draw(st.sampled_from(["keep", "token", "text", "field"]))
    if how == "token" and fields["steps"]:  # one value of a good text replaced
        tokens = fields["steps"].replace("\n", " \n ").split(" ")
        spots = [i for i, t in enumerate(tokens) if t != "\n"]
        tokens[draw(st.sampled_from(spots))] = draw(_TOKEN)
        fields["steps"] = " ".join(tokens).replace(" \n ", "\n")
    elif how == "text":
        fields["steps"] = draw(_TEXT)
    elif how == "field":
        where = draw(st.sampled_from(["n", "rank", "gpu", "attempt", "group"]))
        fields[where] = draw(_TOKEN)
    return fields


def _nan_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(np.asarray(a, dtype=float), np.asarray(b, dtype=float), True))


@pytest.fixture(params=["arrow", "numpy"])
def parser(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both row parsers: pyarrow's (the arrow extra) and numpy's (without it)."""
    if request.param == "numpy":
        with mock.patch.object(columns, "_arrow", return_value=None):
            yield request.param
    else:
        assert columns._arrow() is not None, "the tests need the arrow extra"
        yield request.param


@PROPERTY
@given(st.lists(_flush(), min_size=0, max_size=12))
def test_columns_agree_with_the_record_decoder(parser: str, flushes: list[dict[str, str]]) -> None:
    records: list[StepRecord] = []
    refused = 0
    for fields in flushes:
        try:
            records.extend(decode_steps("9", fields))
        except TelemetryError:
            refused += 1
    decoded = decode_entries(flushes)
    assert decoded.malformed == refused
    _assert_same(decoded.batch, records)


@PROPERTY
@given(st.lists(st.lists(_flush(), min_size=0, max_size=5), min_size=0, max_size=5), st.data())
def test_many_jobs_decoded_at_once_read_as_each_alone(
    parser: str, jobs: list[list[dict[str, str]]], data: st.DataObject
) -> None:
    """The service decodes every job's entries in one parse: each job's part is what decoding
    it alone gives (rows, nodes, refusals), relayed entries among them."""
    relayed = encode_relayed("node9", [decode_header(data.draw(_GOOD))], "0123456789abcdef.1")
    jobs = [*jobs, [relayed]]
    for got, entries in zip(decode_many(jobs), jobs, strict=True):
        alone = decode_entries(entries)
        assert (got.malformed, got.errors) == (alone.malformed, alone.errors)
        assert len(got.batch) == len(alone.batch)
        for name in ("rank", "step", "attempt", "gpu", "ts", "compute_s", "comm_s", "data_s"):
            assert _nan_equal(getattr(got.batch, name), getattr(alone.batch, name)), name
        assert [got.nodes[c] for c in got.node_code] == list(alone.batch.node)
        assert list(got.batch.node) == list(alone.batch.node)
        # A job's node names are its own (the evidence rules look at each of them).
        assert sorted(got.nodes) == sorted(set(alone.batch.node))


def _assert_same(got: RecordBatch, records: list[StepRecord]) -> None:
    want = RecordBatch.from_records(records)
    assert len(got) == len(want)
    for name in ("rank", "step", "attempt", "gpu", "ts", "step_s", "compute_s", "comm_s"):
        assert _nan_equal(getattr(got, name), getattr(want, name)), name
    assert _nan_equal(got.data_s, want.data_s)
    assert list(got.node) == list(want.node)
    assert list(got.group if got.group is not None else [""] * len(got)) == [
        r.group for r in records
    ]


@PROPERTY
@given(st.lists(_GOOD, min_size=0, max_size=10), st.lists(_GOOD, min_size=0, max_size=4))
def test_a_relayed_entry_reads_as_its_flushes_on_the_relays_node(
    parser: str, packed: list[dict[str, str]], plain: list[dict[str, str]]
) -> None:
    relayed = encode_relayed("node9", [decode_header(f) for f in packed], "0123456789abcdef.1")
    entries = [*plain[:2], relayed, *plain[2:]]  # stream order is kept
    records = [r for f in plain[:2] for r in decode_steps("9", f)]
    records += [r for f in packed for r in decode_steps("9", {**f, "node": "node9"})]
    records += [r for f in plain[2:] for r in decode_steps("9", f)]
    decoded = decode_entries(entries)
    assert decoded.malformed == 0
    _assert_same(decoded.batch, records)
    assert [decoded.nodes[c] for c in decoded.node_code] == [r.node for r in records]


def test_a_malformed_flush_is_counted_with_its_reason(parser: str) -> None:
    good = encode_steps(1, "node1", 0, 0, [(0, 1.0, 1.0, None, None, None)])
    decoded = decode_entries([good, {**good, "steps": "0 1 -1 - - -"}, {**good, "rank": "x"}])
    assert decoded.malformed == 2
    assert len(decoded.batch) == 1
    assert any("rank='x'" in e for e in decoded.errors)


def test_a_header_number_too_large_for_a_column_is_one_entry_refused(parser: str) -> None:
    # A job writes its own stream: a rank of 30 digits made every cycle's decode raise
    # (OverflowError building the int64 column), so no job was read until the entry expired.
    good = encode_steps(1, "node1", 0, 0, [(0, 1.0, 1.0, None, None, None)])
    huge = [{**good, name: "9" * 30} for name in ("rank", "gpu", "attempt")]
    edge = {**good, "rank": str(2**31 - 1)}
    decoded = decode_many([[good, *huge], [edge, {**good, "attempt": str(2**31)}]])
    assert [d.malformed for d in decoded] == [3, 1]
    assert [len(d.batch) for d in decoded] == [1, 1]
    assert decoded[1].batch.rank.tolist() == [2**31 - 1]
    assert any("rank='999" in e and "out of range" in e for e in decoded[0].errors)
    with pytest.raises(TelemetryError, match="gpu="):
        decode_steps("1", huge[1])
