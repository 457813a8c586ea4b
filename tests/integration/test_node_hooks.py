"""The site's node hooks (issue 40, item 3): the real service, a real Redis, real hook
processes (a Python script as the site's command), Slurm as the fake scheduler.

A node that turns persistent runs ``on_persistent`` once with the documented JSON, and the
same node forgiven by time runs ``on_forgiven``; a hook that fails or hangs (with a child of
its own) is recorded and killed, and the service cycles on meanwhile; a request a stopped
service took is run by the next one."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_plugin.config.tables import HookSettings
from slurm_plugin.model import keys
from slurm_plugin.policy.rails import PersistencePolicy
from slurm_plugin.service.hooks import NodeHooks, run_hook
from slurm_plugin.service.state import ServiceState
from slurm_plugin.store import hooks
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.conftest import copy_policies, wait_for
from tests.integration.loop_harness import NO_REQUEUE, NODES, Loop, run_cycles, running_job
from tests.integration.test_lifecycle_service import make_loop

__all__ = ["make_loop"]

#: The site's command: appends the JSON it was given to OUT; then "ok" says so and exits 0,
#: "fail" complains and exits 3, "hang" starts a child and both sleep.
HOOK = """\
import json, subprocess, sys, time
out, mode = sys.argv[1], sys.argv[2]
event = json.load(sys.stdin)
with open(out, "a") as f:
    f.write(json.dumps(event) + "\\n")
if mode == "fail":
    print("the ticket system said no", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(out + ".child", "w") as f:
        f.write(str(child.pid))
    time.sleep(300)
print("reported", event["node"])
"""


def _hook(tmp_path: Path, out: str, mode: str = "ok") -> list[str]:
    script = tmp_path / "site-hook.py"
    script.write_text(HOOK)
    return [sys.executable, str(script), str(tmp_path / out), mode]


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _runs(state: ServiceState) -> list[dict[str, str]]:
    return [e for e in state.audit() if e.get("action") == "hook"]


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a container's init may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_node_turned_persistent_runs_its_hook_once_and_forgiven_the_other(
    make_loop: Callable[..., Loop], tmp_path: Path
) -> None:
    """Three jobs of three users see node3 slow: its history turns persistent (observe: no
    drain), recorded as a mark by the service, and ``on_persistent`` runs once with the JSON
    of docs/deploy.md. More incidents on the persistent node run nothing. The jobs end, the
    node stays quiet for the forgiveness period: ``on_forgiven`` runs once."""
    policies = copy_policies(tmp_path / "policies")
    (policies / "no-requeue.toml").write_text(NO_REQUEUE)
    clock = FakeClock()
    jobs = [running_job(clock, str(10 + i), "no-requeue", user=f"user{i}") for i in range(3)]
    slurm = FakeScheduler(jobs, NODES)
    loop = make_loop(
        slurm,
        clock,
        "a",
        policy_dir=policies,
        persistence={"sustained_s": 10},
        hooks={
            "on_persistent": _hook(tmp_path, "persistent.jsonl"),
            "on_forgiven": _hook(tmp_path, "forgiven.jsonl"),
        },
    )
    ids = tuple(j.job_id for j in jobs)
    run_cycles(loop, 0, 40, {"node3": 2.0}, jobs=ids)
    assert loop.state.node_history("node3").state == "persistent"
    loop.service.hooks.join(30)
    run_cycles(loop, 400, 20, {"node3": 2.0}, jobs=ids)  # more incidents: still one mark
    loop.service.hooks.join(30)

    (marked,) = [e for e in loop.state.audit() if e.get("action") == "mark"]
    assert (marked["node"], marked["now"], marked["by"]) == ("node3", "persistent", "service")
    (event,) = _lines(tmp_path / "persistent.jsonl")
    assert event["version"] == 1
    assert (event["event"], event["node"], event["by"]) == ("persistent", "node3", "service")
    assert event["decision_id"] == marked["id"]
    assert event["deployment"] == loop.service.settings.deployment
    assert event["was"] in {"ok", "suspect"}
    assert len({i["job"] for i in event["incidents"]}) >= 2
    assert all(i["cause"] == "compute" and i["slowdown_pct"] > 0 for i in event["incidents"])
    assert event["reasons"]
    assert "incidents" in event["reasons"][0]
    (ran,) = _runs(loop.state)
    assert (ran["state"], ran["kind"], ran["node"], ran["of"]) == (
        "done",
        "persistent",
        "node3",
        marked["id"],
    )
    assert "reported node3" in ran["note"]

    for job_id in ids:  # the jobs end; node3 stays quiet for the forgiveness period
        del slurm.job_table[job_id]
    clock.advance(PersistencePolicy().forgive_after_days * 86400 + 600)
    loop.service.cycle()
    loop.service.hooks.join(30)
    assert loop.state.node_history("node3").state == "ok"
    (forgave,) = [e for e in loop.state.audit() if e.get("action") == "forgive"]
    (event,) = _lines(tmp_path / "forgiven.jsonl")
    assert (event["event"], event["by"], event["was"]) == ("forgiven", "time", "persistent")
    assert event["decision_id"] == forgave["id"]
    assert [(r["kind"], r["state"]) for r in _runs(loop.state)] == [
        ("persistent", "done"),
        ("forgiven", "done"),
    ]
    assert hooks.waiting(loop.state.client) == 0
    assert loop.state.client.llen(keys.HOOKS_RUNNING) == 0


def test_a_hanging_hook_is_killed_with_its_child_and_the_service_cycles_on(
    make_loop: Callable[..., Loop], tmp_path: Path
) -> None:
    """The hook starts a child and both sleep: the service's cycles go on while it runs (a
    cycle only starts a hook), one hook runs at a time, and at ``timeout_s`` its whole
    process group is killed and the run recorded as failed."""
    clock = FakeClock()
    loop = make_loop(
        FakeScheduler([running_job(clock)], NODES),
        clock,
        "a",
        hooks={"on_persistent": _hook(tmp_path, "hang.jsonl", "hang"), "timeout_s": 2},
    )
    for node in ("node1", "node2"):
        hooks.push(
            loop.state.client,
            hooks.HookRequest("persistent", node, f"d-{node}", clock(), "alice", "suspect"),
        )
    loop.service.cycle()
    assert loop.service.hooks.busy
    child_file = tmp_path / "hang.jsonl.child"
    wait_for(child_file.exists, 30, "the hook's child to start")
    child = int(child_file.read_text())
    cycles = 0
    while not _runs(loop.state):  # node1's hook not yet recorded: node2's waits its turn
        assert len(_lines(tmp_path / "hang.jsonl")) == 1
        assert loop.service.cycle().error is None
        cycles += 1
        time.sleep(0.05)
    assert cycles >= 3, "the cycles waited for the hook"
    wait_for(lambda: not _alive(child), 10, "the hook's child to be killed")
    (ran,) = _runs(loop.state)
    assert (ran["state"], ran["node"], ran["of"]) == ("failed", "node1", "d-node1")
    assert ran["error"] == "timed out after 2 s"
    assert float(ran["seconds"]) >= 2

    def node2_started() -> bool:
        # node1's run is recorded a moment before its thread ends: a cycle in that moment
        # starts nothing, so cycles go on until one starts node2's.
        assert loop.service.cycle().error is None
        return len(_lines(tmp_path / "hang.jsonl")) == 2

    wait_for(node2_started, 30, "node2's hook to start")
    assert [e["node"] for e in _lines(tmp_path / "hang.jsonl")] == ["node1", "node2"]
    loop.service.hooks.join(30)


def test_a_failing_hook_is_recorded_and_a_taken_request_outlives_a_restart(
    make_loop: Callable[..., Loop], tmp_path: Path
) -> None:
    """A hook that exits 3 is recorded as failed with its complaint; a program that does not
    exist is "cannot run"; a request a stopped service took (on the running list) runs when
    the next service starts, once."""
    clock = FakeClock()
    loop = make_loop(FakeScheduler([running_job(clock)], NODES), clock, "a")
    state = loop.state
    failing = NodeHooks(
        HookSettings(on_forgiven=_hook(tmp_path, "fail.jsonl", "fail")), state, "site"
    )
    hooks.push(state.client, hooks.HookRequest("forgiven", "node4", "d-1", clock(), "time", "p"))
    failing.tick()
    failing.join(30)
    (ran,) = _runs(state)
    assert (ran["state"], ran["error"]) == ("failed", "exit status 3")
    assert "the ticket system said no" in ran["note"]

    missing = run_hook(["/nonexistent/site-hook"], "{}", 5)
    assert not missing.ok
    assert missing.error is not None
    assert missing.error.startswith("cannot run /nonexistent")

    settings = HookSettings(on_persistent=_hook(tmp_path, "again.jsonl"))
    hooks.push(state.client, hooks.HookRequest("persistent", "node2", "d-2", clock(), "x", "ok"))
    assert hooks.take(state.client) is not None  # taken by a service that then stopped
    assert hooks.waiting(state.client) == 0
    restarted = NodeHooks(settings, state, "site")
    restarted.tick()
    restarted.join(30)
    restarted.tick()
    restarted.join(30)
    assert [e["decision_id"] for e in _lines(tmp_path / "again.jsonl")] == ["d-2"]
    assert [r["state"] for r in _runs(state)] == ["failed", "done"]
    assert state.client.llen(keys.HOOKS_RUNNING) == 0
