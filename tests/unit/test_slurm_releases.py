"""The adapter on real output of Slurm 22.05, 24.11 and 26.05 (golden files captured from real
clusters: a 2-node job held by requeuehold, excluded, released; node4 drained), and job state
that text a job controls cannot forge."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_plugin.config import Settings
from slurm_plugin.errors import CommandError, JobNotFoundError, SlurmError
from slurm_plugin.model.cluster import HOLD_UNCLEAR, JobInfo
from slurm_plugin.slurm.parsers import parse_sinfo_json, parse_squeue_json
from slurm_plugin.slurm.release import SlurmRelease, parse_version
from slurm_plugin.slurm.runner import CommandResult
from slurm_plugin.slurm.scheduler import ScontrolScheduler

GOLDEN = Path(__file__).parent / "golden"
RELEASES = ("22.05", "24.11", "26.05")


def golden(release: str, name: str) -> str:
    return (GOLDEN / f"slurm-{release}" / name).read_text()


def only_job(release: str, name: str) -> JobInfo:
    (job,) = parse_squeue_json(golden(release, name))
    return job


@pytest.mark.parametrize("release", RELEASES)
def test_version_names_the_release(release: str) -> None:
    """`scontrol --version` identifies the release, as a tested one."""
    from_version = parse_version(golden(release, "version.out"))
    assert from_version.series == release
    assert from_version.tested


@pytest.mark.parametrize("release", RELEASES)
def test_eviction_sequence_parses_on_every_release(release: str) -> None:
    """Running -> held (requeuehold) -> excluded -> released, as each release prints it."""
    running = only_job(release, "squeue_json_running.out")
    assert (running.running, running.held, running.restarts) == (True, False, 0)
    assert running.nodes == ("node1", "node2")
    assert running.name == 'a "b"; c'
    assert running.comment == 'straggler:policy=evict; x="y z"'
    assert (running.partition, running.user, running.node_count) == ("debug", "root", 2)
    assert running.requeue
    assert running.time_limit_s == 1800.0

    held = only_job(release, "squeue_json_held.out")
    assert (held.state, held.held, held.priority, held.restarts) == ("PENDING", True, 0, 1)
    assert held.nodes == ()
    assert held.admin_comment == "straggler: compute node1 +5.0% annotate [d-0123456789ab]"

    assert only_job(release, "squeue_json_excluded.out").excluded == ("node1",)
    released = only_job(release, "squeue_json_released.out")
    assert released.excluded == ("node1",)
    assert not released.held
    assert "node1" not in released.nodes


@pytest.mark.parametrize("release", RELEASES)
def test_a_runs_unique_id_where_the_release_gives_one(release: str) -> None:
    """26.05 gives every run of a job its SLUID (a requeue starts a new run: a new one);
    22.05 and 24.11 give none, and nothing else is taken for one."""
    running = only_job(release, "squeue_json_running.out").sluid
    requeued = only_job(release, "squeue_json_held.out").sluid
    if release == "26.05":
        assert (running, requeued) == ("s8KHM8PARCN500", "s8KHM8PARFRZ00")
        assert only_job(release, "squeue_json_released.out").sluid == requeued
    else:
        assert (running, requeued) == (None, None)
    document = json.loads(golden("26.05", "squeue_json_running.out"))
    for forged in ("", "s", "s8KHM8PARCN500; x", "x8KHM8PARCN500", 12345, None):
        document["jobs"][0]["step_id"]["sluid"] = forged
        assert parse_squeue_json(json.dumps(document))[0].sluid is None


@pytest.mark.parametrize("release", RELEASES)
def test_sinfo_of_every_shape(release: str) -> None:
    """`sinfo --json` of 22.05 (a node list) and of 23.02+ (node groups): the same nodes."""
    running = {n.name: n for n in parse_sinfo_json(golden(release, "sinfo_json_running.out"))}
    assert set(running) == {"node1", "node2", "node3", "node4"}
    assert all(n.usable and not n.drained for n in running.values())
    assert running["node2"].state == "mixed"
    assert running["node1"].partitions == ("debug",)
    drained = {n.name: n for n in parse_sinfo_json(golden(release, "sinfo_json_drained.out"))}
    assert drained["node4"].drained
    assert not drained["node4"].usable
    assert drained["node4"].reason == "straggler: test drain [d-0123456789ab]"
    assert [n for n in drained.values() if n.drained] == [drained["node4"]]


def test_sinfo_groups_merge_partitions_and_expand_hostlists() -> None:
    """A node in two partitions is one node with both; group names may be hostlists."""
    doc = {
        "sinfo": [
            {
                "nodes": {"nodes": ["node[1-2]"]},
                "node": {"state": ["IDLE"]},
                "reason": {"description": ""},
                "partition": {"name": name},
            }
            for name in ("debug", "gpu")
        ],
        "errors": [],
    }
    nodes = parse_sinfo_json(json.dumps(doc))
    assert [(n.name, n.partitions) for n in nodes] == [
        ("node1", ("debug", "gpu")),
        ("node2", ("debug", "gpu")),
    ]


@pytest.mark.parametrize(
    "doc",
    [
        {"jobs": [], "errors": [{"error": "Unable to contact slurm controller"}]},
        {"jobs": [], "errors": [{"description": "Slurm controller not responding"}]},
        {"sinfo": [{"nodes": {"nodes": []}}], "errors": []},
        {"sinfo": [{"nodes": "node1"}], "errors": []},
    ],
)
def test_errors_and_empty_groups_are_errors(doc: dict[str, Any]) -> None:
    """An answer with errors (slurmctld away) is never read as "no jobs" or "no nodes"."""
    with pytest.raises(SlurmError):
        (parse_squeue_json if "jobs" in doc else parse_sinfo_json)(json.dumps(doc))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("slurm 22.05.8\n", SlurmRelease(22, 5, 8)),
        ("slurm-wlm 24.11.5", SlurmRelease(24, 11, 5)),
        ("slurm 26.05.0-0rc1", SlurmRelease(26, 5, 0)),
        ("slurm 23.02", SlurmRelease(23, 2, 0)),
    ],
)
def test_parse_version(text: str, expected: SlurmRelease) -> None:
    """Every spelling of `scontrol --version` we have seen."""
    assert parse_version(text) == expected


def test_release_capabilities() -> None:
    """What differs between releases is decided by the release, in one place."""
    old, new, odd = SlurmRelease(22, 5, 8), SlurmRelease(24, 11, 5), SlurmRelease(27, 11)
    assert (old.scontrol_json, new.scontrol_json) == (False, True)
    assert (old.cgroup_plugin_disabled, new.cgroup_plugin_disabled) == (False, True)
    assert (old.run_ids, new.run_ids, SlurmRelease(25, 11).run_ids) == (False, False, True)
    assert not odd.tested
    with pytest.raises(SlurmError, match="cannot read a Slurm version"):
        parse_version("scontrol: command not found")


# -- job state that a job cannot forge --------------------------------------------------------


class CannedSlurm:
    """The command seam with the answers one release gave: `scontrol --version`, the JSON of one
    held job (for `squeue --json` and `scontrol --json show job`), its `scontrol -o` text."""

    def __init__(self, release: str, document: dict[str, Any], text: str) -> None:
        self.version = golden(release, "version.out")
        self.document = document
        self.text = text
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], **_: object) -> CommandResult:
        args = tuple(argv)
        self.calls.append(args)
        if args[1:] == ("--version",):
            out = self.version
        elif args[0].endswith("squeue") or "--json" in args:
            out = json.dumps(self.document)
        elif args[1:4] == ("-o", "show", "job"):
            out = self.text
        else:
            raise CommandError(args, "not canned")
        return CommandResult(args, 0, out, "")


def _held(release: str) -> tuple[dict[str, Any], str]:
    """The held job of a release: its JSON document and its `scontrol -o show job` line."""
    document = json.loads(golden(release, "squeue_json_held.out"))
    return document, golden(release, "show_job_held.out")


def _job_via_scheduler(slurm: CannedSlurm, job_id: str) -> JobInfo:
    return ScontrolScheduler(Settings(), runner=slurm).job(job_id)


@pytest.mark.parametrize("release", RELEASES)
def test_submit_line_and_comment_cannot_forge_state(release: str) -> None:
    """The reproduction: `--wrap "sleep 600 # Restarts=7 NodeList=node9 JobState=RUNNING"`
    and the same text in --comment leave the job held, on no node, with its real restarts."""
    document, line = _held(release)
    hostile = " Restarts=7 NodeList=node9 JobState=RUNNING Priority=5 ExcNodeList=(null)"
    job = document["jobs"][0]
    job["comment"] = f"note{hostile}"
    job["name"] = f"wrap{hostile}"
    forged = re.sub(r"Comment=\S*", lambda _: f"Comment=note{hostile}", line, count=1)
    forged = forged.replace("JobName=", f"JobName=wrap{hostile} Original=", 1)
    forged = forged.replace("StdErr=", f"SubmitLine=sbatch --wrap sleep 600 #{hostile} StdErr=", 1)
    seen = _job_via_scheduler(CannedSlurm(release, document, forged), str(job["job_id"]))
    assert (seen.state, seen.held, seen.restarts, seen.nodes) == ("PENDING", True, 1, ())
    assert seen.excluded == ()
    assert seen.comment == f"note{hostile}"


@pytest.mark.parametrize("release", RELEASES)
def test_a_comment_cannot_make_a_hold_ours(release: str) -> None:
    """Issue 38, item 1: an admin holds a job whose comment (after Reason= in the line) or
    name (before it) says `Reason=job_requeued_in_held_state`; read naively, the last (or
    first) wins and the admin's hold reads as our requeuehold, which the executor releases.
    Two reasons in one line are unclear, never ours; one reason, however often, is itself."""
    document, line = _held(release)
    admin = line.replace("Reason=job_requeued_in_held_state", "Reason=JobHeldAdmin", 1)
    assert "Reason=JobHeldAdmin" in admin
    ours = "Reason=job_requeued_in_held_state"
    by_comment = re.sub(r"Comment=\S*", lambda _: f"Comment=ckpt {ours}", admin, count=1)
    by_name = admin.replace("JobName=", f"JobName=x {ours} Original=", 1)
    job_id = str(document["jobs"][0]["job_id"])
    for forged in (by_comment, by_name):
        assert forged.count("Reason=") == 2
        scheduler = ScontrolScheduler(Settings(), runner=CannedSlurm(release, document, forged))
        assert scheduler.hold_reason(job_id) == HOLD_UNCLEAR
    plain = ScontrolScheduler(Settings(), runner=CannedSlurm(release, document, admin))
    assert plain.hold_reason(job_id) == "JobHeldAdmin"
    echoed = re.sub(r"Comment=\S*", lambda _: "Comment=Reason=JobHeldAdmin", admin, count=1)
    same = ScontrolScheduler(Settings(), runner=CannedSlurm(release, document, echoed))
    assert same.hold_reason(job_id) == "JobHeldAdmin"
    assert (
        ScontrolScheduler(Settings(), runner=CannedSlurm(release, document, line)).hold_reason(
            job_id
        )
        == "job_requeued_in_held_state"
    )


def test_real_submit_line_injection_of_26_05() -> None:
    """Slurm 26.05's own output for the injected job: held, 0 restarts, no nodes."""
    document = json.loads(golden("26.05", "squeue_json_submitline_injection.out"))
    slurm = CannedSlurm("26.05", document, golden("26.05", "show_job_submitline_injection.out"))
    seen = _job_via_scheduler(slurm, "2")
    assert (seen.state, seen.held, seen.restarts, seen.nodes) == ("PENDING", True, 0, ())
    assert ("scontrol", "--json", "show", "job", "2") in slurm.calls


def test_unknown_job_is_an_error_not_a_guess() -> None:
    """A job Slurm does not list is a SlurmError (22.05 filters squeue's list in code)."""
    document, line = _held("22.05")
    with pytest.raises(JobNotFoundError, match="not known"):
        _job_via_scheduler(CannedSlurm("22.05", document, line), "4242")


_FIELDS = st.sampled_from(
    [
        "JobId", "JobState", "Restarts", "NodeList", "ExcNodeList", "Priority", "Reason",
        "Requeue", "Partition", "UserId", "NumNodes", "Comment", "AdminComment",
    ]
)  # fmt: skip
_VALUES = st.one_of(
    st.sampled_from(["RUNNING", "COMPLETED", "7", "0", "node9", "node[1-9]", "(null)", "root(0)"]),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12),
)
_HOSTILE = st.lists(
    st.tuples(_FIELDS, _VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"), min_size=1, max_size=6
).map(" ".join)


@settings(max_examples=150, deadline=None)
@given(
    release=st.sampled_from(RELEASES),
    name=_HOSTILE,
    comment=_HOSTILE,
    submit=_HOSTILE,
)
def test_job_controlled_text_never_changes_parsed_state(
    release: str, name: str, comment: str, submit: str
) -> None:
    """Job names, comments and submit lines made of `Key=Value` text, in both the JSON and the
    `scontrol -o` text: what the service trusts stays what Slurm says."""
    document, line = _held(release)
    job_id = str(document["jobs"][0]["job_id"])
    expected = _job_via_scheduler(CannedSlurm(release, document, line), job_id)
    job = document["jobs"][0]
    job.update(name=name, comment=comment, submit_line=submit, command=submit)
    forged = (
        line.replace("JobName=", f"JobName={name} X=", 1)
        .replace("Comment=", f"Comment={comment} X=", 1)
        .replace("StdErr=", f"SubmitLine={submit} StdErr=", 1)
    )
    seen = _job_via_scheduler(CannedSlurm(release, document, forged), job_id)
    trusted = ("job_id", "state", "reason", "nodes", "excluded", "restarts", "requeue",
               "partition", "node_count", "user", "priority", "held")  # fmt: skip
    assert {k: getattr(seen, k) for k in trusted} == {k: getattr(expected, k) for k in trusted}
    assert (seen.name, seen.comment) == (name, comment)


def test_invalid_job_id_of_scontrol_json_is_job_not_found() -> None:
    """24.11+: `scontrol --json show job` refusing the id is "not found", not "Slurm away"
    (recover() closes the decision of a vanished job instead of retrying forever)."""

    class Refusing(CannedSlurm):
        def __call__(self, argv: Sequence[str], **kw: object) -> CommandResult:
            if "--json" in argv and argv[0].endswith("scontrol"):
                raise CommandError(argv, "exit 1: slurm_load_jobs error: Invalid job id specified")
            return super().__call__(argv, **kw)

    document, line = _held("24.11")
    with pytest.raises(JobNotFoundError, match="Invalid job id"):
        _job_via_scheduler(Refusing("24.11", document, line), "7")
    away = CannedSlurm("24.11", {"jobs": [], "errors": [{"error": "connect failure"}]}, line)
    with pytest.raises(SlurmError, match="connect failure") as caught:
        _job_via_scheduler(away, "7")
    assert not isinstance(caught.value, JobNotFoundError)
