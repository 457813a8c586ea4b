"""Reading traces and their companions: both readers (pyarrow's and the csv module's) give
the same columns, and every malformed file is one clear error naming the file and the row."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from slurm_plugin.backtest import infer_attempts
from slurm_plugin.cli.main import cli
from slurm_plugin.errors import TraceError
from slurm_plugin.trace import read_trace
from tests.scenarios.generator import JobSpec, generate, step_change, write_csv

HEADER = "job_id,rank,node,gpu,step,ts,step_s,compute_s,comm_s,data_s\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty file"),
        ("job_id,rank,node\n1,0,n1\n", "missing column(s) step, ts, step_s"),
        (HEADER, "no records"),
        (HEADER + "1,0,n1,0,0,100.0,0.1,x,0.1,\n", "row 2: column 'compute_s': not a number"),
        (
            HEADER + "1,0,n1,0,0,100.0,0.1,0.1,0.1,\n1,0,n1,0,1.5,101,0.1,,,\n",
            "row 3: column 'step' must be an integer",
        ),
        (HEADER + "1,0,n1,0,0,100.0\n", "row 2 has 6 fields"),
        (HEADER + "1,0,n1,0,0,inf,0.1,,,\n", "column 'ts' must be finite"),
        (HEADER + "1,-1,n1,0,0,100.0,0.1,,,\n", "must be >= 0"),
    ],
)
def test_bad_traces_name_the_problem(text: str, message: str) -> None:
    """Missing columns, bad numbers and empty files are clear errors."""
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_trace(io.StringIO(text))


def test_optional_cells_and_unsorted_rows() -> None:
    """Empty phase cells are 'not measured'; rows are put in ts order."""
    text = HEADER + '2,1,"n 2",0,1,200.0,0.1,,,\n1,0,n1,1,0,100.0,0.2,0.15,0.04,0.01\n'
    trace = read_trace(io.StringIO(text))
    assert trace.job_id.tolist() == ["1", "2"]
    assert trace.node.tolist() == ["n1", "n 2"]
    assert np.isnan(trace.compute_s[1])
    assert trace.compute_s[0] == pytest.approx(0.15)


def _careful_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read as an install without the arrow extra does: pyarrow cannot be imported."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.csv", None)


def test_both_readers_read_the_same_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow's reader (the arrow extra) and the csv-module reader give the same columns
    and names: empty phase and gpu cells, quoted names, groups, rows out of ts order."""
    batch = generate(JobSpec("9", 16, 40, seed=4, compute_slow={3: step_change(0.2, 10)}))
    path = tmp_path / "t.csv"
    write_csv([("9", batch), ("10", batch)], str(path))
    lines = path.read_text().splitlines()
    extra = [
        '11,0,"n, 1",,0,100.5,0.2,,,,stage0',
        "11,1,n2,3,0,100.25,0.2,0.1,0.05,0.01,",
        '11,1,n2,3,1,100.75,0.2,0.1,"0.05",0.01,stage1',
    ]
    path.write_text("\n".join([lines[0] + ",group", *(f"{x}," for x in lines[1:]), *extra]) + "\n")
    fast = read_trace(path)
    _careful_only(monkeypatch)
    careful = read_trace(path)
    assert len(fast) == len(careful) == 2 * 16 * 40 + 3
    for name in ("job_names", "node_names", "group_names"):
        assert getattr(fast, name) == getattr(careful, name), name
    for name in ("job_code", "node_code", "group_code", "rank", "gpu", "step"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(careful, name), err_msg=name)
    for name in ("ts", "step_s", "compute_s", "comm_s", "data_s"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(careful, name), err_msg=name)
    assert "n, 1" in fast.node_names
    assert fast.labelled
    first = int(np.argmin(fast.ts))  # 100.25 s, the second extra row: sorted to the front
    assert (fast.job_id[first], fast.node[first], fast.group[first]) == ("11", "n2", "")
    assert np.isnan(fast.compute_s[np.flatnonzero(fast.node == "n, 1")[0]])


@pytest.mark.parametrize("pyarrow", [True, False])
def test_bad_files_are_one_error_either_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pyarrow: bool
) -> None:
    """With or without pyarrow: a cell pandas would call missing ("NA") is not a number, a
    required cell left empty is an error, a file that is not UTF-8 is named."""
    if not pyarrow:
        _careful_only(monkeypatch)
    path = tmp_path / "t.csv"
    path.write_text(HEADER + "1,0,n1,0,0,100.0,0.1,NA,0.1,\n")
    with pytest.raises(TraceError, match="row 2: column 'compute_s': not a number: 'NA'"):
        read_trace(path)
    path.write_text(HEADER + "1,0,n1,0,0,100.0,0.1,0.1,0.1,\n1,,n1,0,1,101.0,0.1,,,\n")
    with pytest.raises(TraceError, match="row 3: column 'rank': not a number"):
        read_trace(path)
    path.write_bytes(HEADER.encode() + b"1,0,n\xff1,0,0,100.0,0.1,,,\n")
    with pytest.raises(TraceError, match=r"t\.csv: not UTF-8 text"):
        read_trace(path)


def test_attempts_are_inferred_from_steps_going_back() -> None:
    """A rank whose step number drops (restart from a checkpoint) starts a new attempt."""
    jobs = np.array([0, 0, 0, 0, 1, 0, 0])
    ranks = np.array([0, 1, 0, 1, 0, 0, 1])
    steps = np.array([5, 5, 6, 6, 9, 3, 3])
    assert infer_attempts(jobs, ranks, steps).tolist() == [0, 0, 0, 0, 0, 1, 1]
    # Ranks too large to pack with the job into one integer key give the same answer.
    huge = ranks * 2**61
    assert infer_attempts(jobs, huge, steps).tolist() == [0, 0, 0, 0, 0, 1, 1]


def test_without_pyarrow_the_backtest_runs_and_says_how_to_read_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An install without the arrow extra replays the same trace to the same detections and
    prints one hint line."""
    jobs = [("7", generate(JobSpec("7", 32, 200, seed=5, compute_slow={3: step_change(0.3, 80)})))]
    path = tmp_path / "t.csv"
    write_csv(jobs, str(path))
    with_arrow = CliRunner().invoke(cli, ["backtest", str(path), "--json"])
    assert "hint:" not in CliRunner().invoke(cli, ["backtest", str(path)]).stdout
    _careful_only(monkeypatch)
    without = CliRunner().invoke(cli, ["backtest", str(path), "--json"])
    assert with_arrow.exit_code == without.exit_code == 0, without.output
    assert json.loads(without.stdout) == json.loads(with_arrow.stdout)
    assert json.loads(without.stdout)["detections"]
    table = CliRunner().invoke(cli, ["backtest", str(path)])
    assert table.exit_code == 0, table.output
    assert "hint: install the 'arrow' extra (pyarrow)" in table.stdout


@pytest.mark.parametrize(
    ("jobs_csv", "error"),
    [
        (
            b"job_id,start_ts,end_limit_ts\n7,1e308,\n",
            "t.jobs.csv: line 2, start_ts: 1e308 is not a unix time in seconds",
        ),
        (
            b"job_id,start_ts,end_limit_ts\n7,1000,-1e308\n",
            "t.jobs.csv: line 2, end_limit_ts: -1e308 is not a unix time in seconds",
        ),
        (b"job_id,start_ts,end_limit_ts\n7,\xff\xfe,\n", "t.jobs.csv: not UTF-8 text (byte 0xff"),
    ],
)
def test_a_companion_with_an_absurd_time_or_bad_bytes_is_one_clear_error(
    tmp_path: Path, jobs_csv: bytes, error: str
) -> None:
    """Issue 38, item 9: companions took +-1e308 times (a decision "saved" 10^300 s) and
    answered a non-UTF-8 byte with a misleading error; each is now one line naming the file."""
    batch = generate(JobSpec("7", 16, 100, seed=1))
    path = tmp_path / "t.csv"
    write_csv([("7", batch)], str(path))
    (tmp_path / "t.jobs.csv").write_bytes(jobs_csv)
    result = CliRunner().invoke(cli, ["backtest", str(path)])
    assert result.exit_code != 0
    assert error in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "Traceback" not in result.output


def test_a_byte_order_mark_is_read_past(tmp_path: Path) -> None:
    """Issue 38, item 9: a trace or companion saved with a byte-order mark (spreadsheets do)
    read as "missing column job_id"; the mark is read past."""
    batch = generate(JobSpec("7", 16, 100, seed=1))
    path = tmp_path / "t.csv"
    write_csv([("7", batch)], str(path))
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    start = float(batch.ts.min())
    (tmp_path / "t.jobs.csv").write_bytes(
        b"\xef\xbb\xbfjob_id,start_ts,end_limit_ts\n" + f"7,{start},\n".encode()
    )
    result = CliRunner().invoke(cli, ["backtest", str(path)])
    assert result.exit_code == 0, result.output
    assert "no TRACE.jobs.csv" not in result.output
