"""The relay's pure parts: its entry encoding and how it tells which job a process runs in."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_plugin.errors import TelemetryError
from slurm_plugin.model.records import decode_steps, encode_relayed, encode_steps, split_entry
from slurm_plugin.telemetry.relay import job_of_process


def test_a_relayed_entry_holds_each_ranks_flush_with_the_relays_node() -> None:
    flushes = [
        encode_steps(
            rank, "claimed", rank % 8, 0, [(5, 1.0, 0.1, 0.08, None, None)], flush=f"{rank:016x}.1"
        )
        for rank in range(3)
    ]
    split = split_entry(encode_relayed("node7", flushes))
    assert [f["rank"] for f in split] == ["0", "1", "2"]
    assert {f["node"] for f in split} == {"node7"}
    assert [f["flush"] for f in split] == [f"{rank:016x}.1" for rank in range(3)]
    records = [r for f in split for r in decode_steps("9", f)]
    assert [(r.rank, r.node, r.step) for r in records] == [(i, "node7", 5) for i in range(3)]


def test_a_plain_entry_is_its_own_flush() -> None:
    fields = encode_steps(1, "node1", 0, 0, [(0, 1.0, 0.1, None, None, None)])
    assert split_entry(fields) == [fields]


@pytest.mark.parametrize(
    ("relayed", "error"),
    [
        ("{not json", "not JSON"),
        ('{"rank": "1"}', "at most"),
        ('[{"rank": 1}]', "strings"),
        ('["x"]', "strings"),
        ("[" + ",".join(["{}"] * 5000) + "]", "at most 4096"),
    ],
)
def test_a_malformed_relayed_entry_is_refused(relayed: str, error: str) -> None:
    with pytest.raises(TelemetryError, match=error):
        split_entry({"node": "node1", "relayed": relayed})


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
