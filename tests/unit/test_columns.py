"""The service's columnar decoding accepts and refuses exactly what the record decoder does,
and yields the same values."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model.batch import RecordBatch
from slurm_plugin.model.columns import decode_flushes
from slurm_plugin.model.records import StepRecord, decode_steps, encode_steps

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
_TOKEN = st.sampled_from(
    ["0", "1", "-", "-1", "1.5", "1e3", "1e999", "nan", "inf", "1_0", "+2", "1.2.3", ".", "e", ""]
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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_flush(), min_size=0, max_size=12))
def test_columns_agree_with_the_record_decoder(flushes: list[dict[str, str]]) -> None:
    records: list[StepRecord] = []
    refused = 0
    for fields in flushes:
        try:
            records.extend(decode_steps("9", fields))
        except TelemetryError:
            refused += 1
    decoded = decode_flushes(flushes)
    assert decoded.malformed == refused
    got, want = decoded.batch(), RecordBatch.from_records(records)
    assert len(got) == len(want)
    for name in ("rank", "step", "attempt", "gpu", "ts", "step_s", "compute_s", "comm_s"):
        assert _nan_equal(getattr(got, name), getattr(want, name)), name
    assert _nan_equal(got.data_s, want.data_s)
    assert list(got.node) == list(want.node)
    assert list(got.group if got.group is not None else [""] * len(got)) == [
        r.group for r in records
    ]


def test_a_batch_of_some_flushes_holds_their_steps_only() -> None:
    steps = [(s, 100.0 + s, 1.0, 0.5, None, 0.1) for s in range(3)]
    flushes = [encode_steps(rank, f"node{rank}", 0, 0, steps[: rank + 1]) for rank in range(3)]
    decoded = decode_flushes(flushes)
    batch = decoded.batch(np.array([True, False, True]))
    assert list(batch.rank) == [0, 2, 2, 2]
    assert list(batch.step) == [0, 0, 1, 2]
    assert list(batch.node) == ["node0", "node2", "node2", "node2"]
    assert np.isnan(batch.comm_s).all()


def test_a_malformed_flush_is_counted_with_its_reason() -> None:
    good = encode_steps(1, "node1", 0, 0, [(0, 1.0, 1.0, None, None, None)])
    decoded = decode_flushes([good, {**good, "steps": "0 1 -1 - - -"}, {**good, "rank": "x"}])
    assert decoded.malformed == 2
    assert len(decoded.batch()) == 1
    assert any("rank='x'" in e for e in decoded.errors)
