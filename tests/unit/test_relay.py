"""The relay's pure parts: its entry encoding and how it tells which job a process runs in."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_plugin.model.columns import decode_entries
from slurm_plugin.model.records import decode_header, encode_steps
from slurm_plugin.model.relayed import encode_relayed
from slurm_plugin.telemetry.relay_peers import job_of_process


def _flushes() -> list[dict[str, str]]:
    return [
        encode_steps(rank, "claimed", rank % 8, 0, [(5, 1.0, 0.1, 0.08, None, None)], "pp=1")
        for rank in range(3)
    ]


def test_a_relayed_entry_holds_its_ranks_steps_as_rows() -> None:
    entry = encode_relayed("node7", [decode_header(f) for f in _flushes()], "0123456789abcdef.3")
    assert (entry["node"], entry["groups"], entry["n"]) == ("node7", "pp=1", "3")
    assert entry["rows"].split("\n")[1] == "1 1 0 1 5 1.000000 0.1 0.08 - -"
    decoded = decode_entries([entry])
    batch = decoded.batch
    assert batch.group is not None
    assert (list(batch.rank), list(batch.node), list(batch.group)) == (
        [0, 1, 2],
        ["node7"] * 3,
        ["pp=1"] * 3,
    )


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"n": "4"}, "holds 3 rows"),
        ({"groups": "bad,label"}, "group label"),
        ({"rows": "0 0 0 2 5 1 1 - - -\n1 0 0 0 5 1 1 - - -\n2 0 0 0 5 1 1 - - -"}, "out of range"),
        ({"rows": "0 0 0 0 5 1 nan - - -\n1 0 0 0 5 1 1 - - -\n2 0 0 0 5 1 1 - - -"}, "token"),
        ({"rows": "0 0 0 0 5 1 -1 - - -\n1 0 0 0 5 1 1 - - -\n2 0 0 0 5 1 1 - - -"}, "range"),
        ({"node": ""}, "node"),
    ],
)
def test_a_malformed_relayed_entry_is_refused_whole(change: dict[str, str], error: str) -> None:
    entry = encode_relayed("node7", [decode_header(f) for f in _flushes()], "0123456789abcdef.3")
    decoded = decode_entries([{**entry, **change}])
    assert (decoded.malformed, len(decoded.batch)) == (1, 0)
    assert error in decoded.errors[0]


def _proc(root: Path, pid: int, cgroup: str | None, environ: bytes | None) -> None:
    (root / str(pid)).mkdir(parents=True)
    if cgroup is not None:
        (root / str(pid) / "cgroup").write_text(cgroup)
    if environ is not None:
        (root / str(pid) / "environ").write_bytes(environ)


def test_the_job_of_a_process_comes_from_its_cgroup_before_its_environment(tmp_path: Path) -> None:
    slurm_v2 = "0::/system.slice/slurmstepd.scope/job_812/step_0/user/task_0\n"
    slurm_v1 = "5:cpuset:/slurm/uid_1000/job_77/step_batch\n3:memory:/\n"
    _proc(tmp_path, 10, slurm_v2, b"SLURM_JOB_ID=999\0HOME=/x\0")
    _proc(tmp_path, 11, slurm_v1, None)
    _proc(tmp_path, 12, "0::/user.slice/session-3.scope\n", b"PATH=/bin\0SLURM_JOB_ID=55\0")
    _proc(tmp_path, 13, "0::/user.slice\n", b"PATH=/bin\0")
    assert job_of_process(10, tmp_path) == "812"  # the cgroup wins over a forged environment
    assert job_of_process(11, tmp_path) == "77"
    assert job_of_process(12, tmp_path) == "55"
    assert job_of_process(13, tmp_path) is None
    assert job_of_process(14, tmp_path) is None  # gone
