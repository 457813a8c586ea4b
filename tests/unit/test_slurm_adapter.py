"""Parsers on golden output captured from the dev cluster (Slurm 22.05), and our marks."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_plugin.errors import SlurmError
from slurm_plugin.slurm import marks
from slurm_plugin.slurm.parsers import parse_scontrol_record, parse_sinfo_json, parse_squeue_json

GOLDEN = Path(__file__).parent / "golden"


def test_squeue_json_golden() -> None:
    """A running 3-node job with a hostile name and comment, and a cancelled one."""
    jobs = parse_squeue_json((GOLDEN / "squeue.json").read_text())
    job = next(j for j in jobs if j.job_id == "1")
    assert job.name == 'it\'s a; "test" job'
    assert job.comment == 'straggler:policy=evict; x="y z"'
    assert (job.state, job.running, job.held) == ("RUNNING", True, False)
    assert job.nodes == ("node1", "node2", "node3")
    assert (job.node_count, job.partition, job.user, job.requeue) == (3, "debug", "root", True)
    assert job.time_limit_s == 1800.0
    assert job.start_time is not None


def test_sinfo_json_golden() -> None:
    """Node states, flags and reasons: node4 drained with our reason."""
    nodes = {n.name: n for n in parse_sinfo_json((GOLDEN / "sinfo.json").read_text())}
    assert set(nodes) == {"node1", "node2", "node3", "node4"}
    assert nodes["node4"].flags == ("DRAIN",)
    assert not nodes["node4"].usable
    assert nodes["node1"].usable
    # Typed by hand with a made-up id: it looks like ours but is not, so we never undo it.
    assert nodes["node4"].reason.startswith("straggler:")
    assert not marks.is_ours(nodes["node4"].reason)


def test_scontrol_record_is_not_trusted_with_free_text() -> None:
    """Why no job state is read from `scontrol -o` text: a comment holding `JobState=` text is
    split into a field of its own (golden line of Slurm 24.11)."""
    record = parse_scontrol_record(
        (GOLDEN / "slurm-24.11" / "show_job_comment_injection.out").read_text()
    )
    assert record["JobState"] == "RUNNING"  # the comment's text; the job is held and PENDING
    assert record["Restarts"] == "7"


@pytest.mark.parametrize("text", ["", "[]", '{"jobs": 3}', "{not json"])
def test_malformed_json_is_a_slurm_error(text: str) -> None:
    """Garbage from Slurm is a SlurmError, never an uncaught exception."""
    with pytest.raises(SlurmError):
        parse_squeue_json(text)


def test_marks() -> None:
    """Reasons carry our prefix and decision id; hostile text is neutralised."""
    decision = marks.new_decision_id()
    text = marks.reason("compute node3", 'slow "7%"; rm -rf / [x]', decision)
    assert text.startswith("straggler: compute node3 ")
    assert text.endswith(f"[{decision}]")
    assert '"' not in text
    assert ";" not in text
    assert marks.decision_of(text) == decision
    assert not marks.is_ours("maintenance by bob")
    assert not marks.is_ours(f"someone: copied [{decision}]")


def test_marks_name_their_deployment() -> None:
    """Issue 25: a mark names its deployment; another deployment's mark is not ours, one made
    before marks named theirs is everyone's (as it was); the tag survives a long reason."""
    decision = marks.new_decision_id()
    text = marks.reason("persistent", "x" * 400, decision, "aaaa")
    assert len(text) <= marks.MAX_REASON
    assert text.endswith(f"[{decision}@aaaa]")
    assert marks.decision_of(text) == decision
    assert marks.decision_of(text, "aaaa") == decision
    assert marks.decision_of(text, "bbbb") is None
    assert not marks.is_ours(text, "bbbb")
    legacy = marks.reason("persistent", "slow", decision)
    assert marks.is_ours(legacy, "bbbb")
    assert not marks.is_ours(f"straggler: forged [{decision}@UPPER]", None)


def test_settings_derive_a_deployment_from_the_redis_endpoint() -> None:
    """Two deployments on one Redis server but different databases get different names;
    the password never enters the name; an explicit deployment_id wins."""
    from slurm_plugin.config import Settings  # noqa: PLC0415

    one = Settings(redis={"url": "redis://:secret@10.0.0.5:6379/0"}).deployment
    assert one == Settings(redis={"url": "redis://:other@10.0.0.5:6379/0"}).deployment
    assert one != Settings(redis={"url": "redis://10.0.0.5:6379/1"}).deployment
    assert marks.DEPLOYMENT.match(one)
    assert Settings(deployment_id="prod-a").deployment == "prod-a"
