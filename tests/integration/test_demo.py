"""The demo scenario end to end, asserting on Slurm's answers: a real DDP job (gloo), node3
slowed down by a cgroup CPU quota, detected, the job requeued without node3, resumed from its
checkpoint and completed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_plugin.backtest import run_backtest
from slurm_plugin.config import Settings
from slurm_plugin.demo.export import write_run
from slurm_plugin.demo.report import render
from slurm_plugin.demo.run import REPO, SLOW_NODE, DemoRun, run_scenario, summarize
from slurm_plugin.detection.params import DetectionParams
from slurm_plugin.devcluster import DevCluster
from slurm_plugin.errors import DevClusterError
from slurm_plugin.policy.loader import load_policy
from slurm_plugin.store import decision as decision_record
from slurm_plugin.trace import read_trace
from slurm_plugin.trace_meta import read_context
from tests.integration.demo_why import check_why

#: A real training job whose timings are asserted: run with nothing beside it.
pytestmark = pytest.mark.alone


pytest.importorskip("torch", reason="the torch extra is installed by `make install`")


def _listening_from(run: DemoRun) -> int:
    """The step from which a report on node3 could come: the onset's, or, when node3 was
    reported before the onset (a noise flag: six ranks share two cores), the step the job was
    at when that report's re-arm period ended (the detector reports a node again only after
    ``rearm_s``; documented, and measured on the months in benchmarks/README.md)."""
    assert run.onset_step is not None
    on_node = [decision_record.read(d) for d in run.decisions if d.get("node") == SLOW_NODE]
    early = [r for r in on_node if (r.step or 0) < run.onset_step]
    heard = [r.detected_ts for r in early if r.detected_ts is not None]
    if not heard:
        return run.onset_step
    rearmed_ts = max(heard) + DetectionParams().rearm_s
    steps = [r.step for r in run.records if r.attempt == 0 and r.ts <= rearmed_ts]
    return max([run.onset_step, *steps])


def test_straggler_is_evicted_and_the_job_resumes_elsewhere(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """Final NodeList without node3, Restarts=1, resumed from a checkpoint step > 0,
    COMPLETED, detected within 30 steps of the onset (or of the end of the re-arm period of
    a report on node3 just before the onset)."""
    lines: list[str] = []

    def seen() -> str:
        """What a failure shows: the run as the demo prints it, and what the service decided."""
        log_path = tmp_path / "demo" / "service.log"
        log = log_path.read_text().splitlines() if log_path.exists() else []
        return "\n".join([*lines[-40:], *(x for x in log if "service.cycle" not in x)][-80:])

    try:
        run = run_scenario(
            Settings(),
            cluster,
            tmp_path / "demo",
            policy="evict",
            steps=400,  # node3 slow for minutes: the shipped policy evicts after ~2-3 of them
            slow_at=60,
            quota_pct=10,
            redis_db=10,
            say=lines.append,
            timeout_s=900,  # ~250 s here; what a stuck run shows comes from the timeout
        )
    except DevClusterError as exc:
        pytest.fail(f"{exc}\n{seen()}")
    summary = summarize(run)
    check_why(run)  # node3's ranks: compute up, wait down against the others'
    assert summary["state"] == "COMPLETED", seen()
    assert summary["restarts"] == 1, seen()
    assert "node3" not in summary["final_nodes"]
    assert summary["excluded"] == "node3"
    assert summary["resumed_from_step"] is not None
    assert summary["resumed_from_step"] > 0
    assert summary["detection_delay_steps"] is not None
    assert summary["detection_delay_steps"] >= 0, seen()
    assert summary["detection_step"] - _listening_from(run) <= 30, seen()
    # A flag before the onset (six ranks on two cores lag at times) may be annotated, no more.
    assert summary["actions_before_onset"] == [], seen()
    evictions = [d for d in run.decisions if d.get("action") == "evict"]
    assert [d["node"] for d in evictions] == ["node3"]
    assert evictions[0]["state"] == "verified"
    # The report of this real run: the eviction's states from the audit trail, in order, and
    # the cost of the straggler counted.
    states = [e["state"] for e in run.audit if e.get("id") == evictions[0]["id"]]
    assert states.index("held") < states.index("verified"), states
    assert summary["lost_to_straggler_s"] is not None
    assert summary["lost_to_straggler_s"] > 0
    page = render([(run, summary)])
    assert "the straggler cost" in page
    assert page.count("<svg") == 2
    # The run's first attempt as a trace (what `straggler demo` writes): the backtest on it
    # finds node3 when the live service did and evicts nothing else; a report on another node
    # before it is noise the policy does nothing about (six ranks share two cores: one run
    # flagged node1 at the end of the warm-up, blending in, in the replay only). Whether it
    # evicts at the report the service evicted on is not asserted: that report sits near the
    # "not sure yet" margin (1 run in 4 here: 75 against 73 s), and the live detector saw the
    # node's records a cycle at a time. tests/unit/test_real_runs.py holds two kept runs to
    # every decision.
    trace = tmp_path / "trace.csv"
    assert write_run(run, summary, trace) > 0
    truth = json.loads(trace.with_name("trace.truth.json").read_text())
    assert truth["evicted_nodes"] == ["node3"]
    result = run_backtest(
        read_trace(trace),
        load_policy(REPO / "policies" / "evict.toml"),
        context=read_context(trace),
    )
    stragglers = [d for d in result.detections if d["kind"] == "straggler"]
    found = next((d for d in stragglers if d["node"] == SLOW_NODE), None)
    assert found is not None, result.detections
    assert abs(found["step"] - truth["detection_step"]) <= 5, (found, truth)
    before = [d for d in stragglers if d["step"] < found["step"]]
    assert all(d["action"] == "none" and d["node"] != SLOW_NODE for d in before), before
    assert [d["nodes"] for d in stragglers if d["action"] == "evict"] in ([], [["node3"]])
