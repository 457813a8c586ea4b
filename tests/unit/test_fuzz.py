"""Fuzzing (hypothesis) of everything that parses outside input: stream entries, policy files,
scontrol/squeue/sinfo output, hostlists and trace CSV. No input may crash a parser with
anything but our own error, and the errors name what is wrong."""

from __future__ import annotations

import contextlib
import io
import json
import os
import string
import tomllib
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_plugin.errors import ConfigError, SlurmError, TelemetryError, TraceError
from slurm_plugin.model.records import (
    decode_json_entry,
    decode_steps,
    encode_steps,
)
from slurm_plugin.policy.loader import load_policy
from slurm_plugin.slurm.parsers import (
    collect_hostlist,
    expand_hostlist,
    parse_scontrol_record,
    parse_sinfo_json,
    parse_squeue_json,
)
from slurm_plugin.store import credentials
from slurm_plugin.trace import TRACE_COLUMNS, read_trace

REPO = Path(__file__).resolve().parents[2]
# 300 examples per property in CI; STRAGGLER_FUZZ_EXAMPLES=20000 for a longer hunt.
EXAMPLES = int(os.environ.get("STRAGGLER_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STEP_FIELDS = ("rank", "gpu", "attempt", "n", "step", "ts", "step_s", "compute_s", "comm_s")

text = st.text(alphabet=st.characters(codec="utf-8"), max_size=80)
numberish = st.one_of(
    st.integers(-5, 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "-", "nan", "inf", "1e309", "0x10", " 1", "1 2", "\n", "-0"]),
    text,
)


# -- stream entries -------------------------------------------------------------------------
@FUZZ
@given(
    st.dictionaries(st.sampled_from(["rank", "gpu", "attempt", "n", "node", "steps"]), numberish)
)
def test_steps_entry_decodes_or_names_the_field(fields: dict[str, str]) -> None:
    """Any entry decodes to records or raises TelemetryError naming a field."""
    try:
        records = decode_steps("1", fields)
    except TelemetryError as exc:
        message = str(exc)
        assert any(name in message for name in (*STEP_FIELDS, "step line", "steps")), message
        return
    for record in records:
        assert record.rank >= 0
        assert record.step_s >= 0


raw_step = st.tuples(
    st.integers(0, 10**9),
    st.floats(0, 2e9),
    st.floats(0, 1e4),
    st.one_of(st.none(), st.floats(0, 1e4)),
    st.one_of(st.none(), st.floats(0, 1e4)),
    st.one_of(st.none(), st.floats(0, 1e4)),
)


@FUZZ
@given(
    st.lists(raw_step, min_size=1, max_size=20),
    st.integers(0, 10**6),
    st.integers(0, 64),
    st.sampled_from(["steps", "rank", "n"]),
    numberish,
)
def test_corrupting_a_valid_entry_never_crashes(
    raws: list[tuple[int, float, float, float | None, float | None, float | None]],
    rank: int,
    gpu: int,
    field: str,
    garbage: str,
) -> None:
    """A valid entry round-trips; the same entry with one field replaced by garbage decodes
    or raises TelemetryError, never anything else."""
    fields = encode_steps(rank, "node1", gpu, 0, raws)
    decoded = decode_steps("1", fields)
    assert [r.step for r in decoded] == [s[0] for s in raws]
    assert {r.rank for r in decoded} == {rank}
    fields[field] = garbage
    with contextlib.suppress(TelemetryError):
        decode_steps("1", fields)


@FUZZ
@given(st.dictionaries(st.sampled_from(["json", "x"]), text))
def test_json_entry_decodes_or_raises(fields: dict[str, str]) -> None:
    """Event and GPU entries: an object, or TelemetryError."""
    with contextlib.suppress(TelemetryError):
        assert isinstance(decode_json_entry(fields), dict)


# -- policy files ---------------------------------------------------------------------------
SHIPPED = tomllib.loads((REPO / "policies" / "evict.toml").read_text())
toml_scalar = st.one_of(
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.booleans(),
    st.text(alphabet=string.ascii_letters + "_-", max_size=12),
)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


@FUZZ
@given(
    st.sampled_from(sorted(k for k, v in SHIPPED.items() if isinstance(v, dict))),
    st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=20),
    toml_scalar,
)
def test_policy_with_any_changed_setting_loads_or_names_it(
    tmp_path_factory: object, section: str, key: str, value: object
) -> None:
    """Set any key of a shipped policy section to any value: it loads, or the ConfigError
    names the file and the setting."""
    base = tmp_path_factory.mktemp("policy")  # type: ignore[attr-defined]
    path = base / "fuzzed.toml"
    lines = (REPO / "policies" / "evict.toml").read_text().splitlines()
    header = f"[{section}]"
    index = lines.index(header) if header in lines else len(lines)
    lines.insert(index + 1, f"{key} = {_toml_value(value)}")
    path.write_text("\n".join(lines) + "\n")
    try:
        load_policy(path)
    except ConfigError as exc:
        message = str(exc)
        assert str(path) in message
        assert key in message or "TOML" in message or section in message, message


@FUZZ
@given(text)
def test_policy_file_of_garbage(tmp_path_factory: object, content: str) -> None:
    """Arbitrary text as a policy file: a ConfigError naming the file (or, rarely, valid)."""
    path = tmp_path_factory.mktemp("garbage") / "p.toml"  # type: ignore[attr-defined]
    path.write_text(content)
    try:
        load_policy(path)
    except ConfigError as exc:
        assert str(path) in str(exc)  # noqa: PT017 - hypothesis: no pytest.raises


# -- Slurm output ---------------------------------------------------------------------------
@FUZZ
@given(text)
def test_scontrol_record_of_garbage(line: str) -> None:
    """Arbitrary text: a record or SlurmError."""
    with contextlib.suppress(SlurmError):
        parse_scontrol_record(line)


json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=10,
)
job_item = st.dictionaries(
    st.sampled_from(
        [
            "job_id",
            "name",
            "job_state",
            "nodes",
            "restart_cnt",
            "node_count",
            "priority",
            "time_limit",
            "start_time",
            "excluded_nodes",
            "requeue",
            "comment",
            "user_name",
        ]
    ),
    json_value,
)


@FUZZ
@given(st.lists(job_item, max_size=4), json_value)
def test_squeue_and_sinfo_json_parse_or_raise(items: list[dict[str, object]], junk: object) -> None:
    """squeue/sinfo JSON with any shapes and values: parsed, or SlurmError."""
    for payload in (
        {"jobs": items, "nodes": items},
        {"sinfo": [{"nodes": {"nodes": [i.get("name")]}, "node": i} for i in items]},
        {"jobs": items, "sinfo": items, "errors": junk},
        junk,
    ):
        for parse in (parse_squeue_json, parse_sinfo_json):
            with contextlib.suppress(SlurmError):
                parse(json.dumps(payload))


# -- hostlists ------------------------------------------------------------------------------
@FUZZ
@given(st.text(alphabet=string.ascii_lowercase + string.digits + "[]-,.^_ ", max_size=40))
def test_hostlist_expands_or_raises(expr: str) -> None:
    """Any hostlist expression: a list of names, or SlurmError."""
    try:
        hosts = expand_hostlist(expr)
    except SlurmError as exc:
        assert "hostlist" in str(exc)  # noqa: PT017 - hypothesis: no pytest.raises
        return
    assert all(isinstance(h, str) for h in hosts)


@FUZZ
@given(
    st.lists(
        st.tuples(st.sampled_from(["node", "gpu", "a-b"]), st.integers(0, 2000)),
        min_size=1,
        max_size=30,
        unique=True,
    )
)
def test_hostlist_round_trip(names: list[tuple[str, int]]) -> None:
    """collect then expand gives back the same set of names."""
    hosts = [f"{prefix}{number}" for prefix, number in names]
    assert sorted(expand_hostlist(collect_hostlist(hosts))) == sorted(set(hosts))


# -- trace CSV ------------------------------------------------------------------------------
@FUZZ
@given(
    st.lists(
        st.tuples(
            st.integers(0, 64), st.integers(0, 10**5), st.floats(0, 1e9), st.floats(0.001, 10)
        ),
        min_size=1,
        max_size=20,
    ),
    st.integers(0, 19),
    st.sampled_from(["rank", "step", "ts", "step_s", "compute_s"]),
    st.sampled_from(["x", "-1", "nan", "inf", "1.5", "", '"', "1,2"]),
)
def test_trace_with_one_bad_cell_names_row_and_column(
    rows: list[tuple[int, int, float, float]], row: int, column: str, bad: str
) -> None:
    """A valid trace reads; one corrupted cell reads or raises TraceError naming the column
    (and the row, when it is a cell problem)."""
    header = ",".join(TRACE_COLUMNS)
    lines = [
        f"7,{r},node1,0,{s},{ts!r},{d!r},{d / 2!r},{d / 2!r},0,stage{r % 2}" for r, s, ts, d in rows
    ]
    assert len(read_trace(io.StringIO("\n".join([header, *lines]) + "\n"))) == len(rows)
    target = min(row, len(lines) - 1)
    cells = lines[target].split(",")
    cells[TRACE_COLUMNS.index(column)] = bad
    lines[target] = ",".join(cells)
    try:
        read_trace(io.StringIO("\n".join([header, *lines]) + "\n"))
    except TraceError as exc:
        message = str(exc)
        assert column in message or "field" in message or "row" in message, message


@FUZZ
@given(text)
def test_trace_of_garbage(content: str) -> None:
    """Arbitrary text as a trace: TraceError (or, rarely, a valid trace)."""
    with contextlib.suppress(TraceError):
        read_trace(io.StringIO(content))


@FUZZ
@given(st.dictionaries(st.sampled_from(["url", "tls_ca_file", "x"]), text))
def test_credential_file_round_trips_any_value(redis: dict[str, str]) -> None:
    """Whatever the settings hold, the credential file parses back to the same values."""
    values = {"redis": redis}
    assert tomllib.loads(credentials.render("5", values)) == values
