"""Real runs of the dev cluster, replayed against what they know (issue 36).

`straggler demo` writes each run's first attempt as a trace with its companions and its truth
(``TRACE.truth.json``: the node slowed for real, when, and what the live service decided, in
order). Two such runs are kept in ``tests/data/runs/``: the demo's DDP job (6 gloo ranks on
node1-3, node3 held to 10 % of a CPU from step ~60) under ``evict``, up to the requeue the
service made, and the same job under ``observe``, slowed to its end. The backtest on each,
under the shipped policy, must find what the run knows (node3, from the onset, never before)
and decide what the live service decided, where and about when: the service and the replay
share one lifecycle, and this holds it on telemetry no generator made.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slurm_plugin.backtest import run_backtest
from slurm_plugin.demo.export import time_limit_s
from slurm_plugin.policy.loader import load_policy
from slurm_plugin.trace import read_trace
from slurm_plugin.trace_meta import companion, read_context

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "tests" / "data" / "runs"


def replay(name: str, policy: str = "evict") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's truth and the backtest's detections under the shipped ``policy``."""
    path = RUNS / f"{name}.csv"
    truth = json.loads(companion(path, "truth").with_suffix(".json").read_text())
    result = run_backtest(
        read_trace(path),
        load_policy(REPO / "policies" / f"{policy}.toml"),
        context=read_context(path),
    )
    return truth, result.detections


@pytest.mark.parametrize("name", ["demo-evict", "demo-observe"])
def test_the_slowed_node_is_found_from_the_onset_and_never_before(name: str) -> None:
    truth, detections = replay(name)
    onset, slow = truth["onset_ts"], truth["slow_node"]
    stragglers = [d for d in detections if d["kind"] == "straggler"]
    assert stragglers, detections
    assert [d for d in stragglers if d["ts"] < onset] == []
    assert {d["node"] for d in stragglers} == {slow}
    first = stragglers[0]
    assert first["step"] >= truth["onset_step"]
    # As soon as the live service saw it (the same steps, read a cycle at a time there).
    assert abs(first["step"] - truth["detection_step"]) <= 3, (first["step"], truth)
    assert first["ts"] - onset < 15.0


@pytest.mark.parametrize(("name", "policy"), [("demo-evict", "evict"), ("demo-observe", "observe")])
def test_the_replay_decides_what_the_live_service_decided(name: str, policy: str) -> None:
    """Under the run's own policy: the same decisions in the same order (kind, node, action),
    each within a few steps of the live one (a sync stall's step is where a cycle found it)."""
    truth, detections = replay(name, policy)
    live = truth["decisions"]
    assert [(d["kind"], d["node"], d["action"]) for d in detections] == [
        (d["kind"], d["node"], d["action"]) for d in live
    ]
    for ours, theirs in zip(detections, live, strict=True):
        assert abs(ours["step"] - theirs["step"]) <= 5, (ours, theirs)


def test_the_eviction_is_where_and_when_the_service_made_it() -> None:
    """The evict run: the eviction excludes the same node, at about the moment the service
    held the job."""
    truth, detections = replay("demo-evict")
    (evicted,) = [d for d in detections if d["action"] == "evict"]
    assert evicted["nodes"] == truth["evicted_nodes"] == [truth["slow_node"]]
    acted = evicted.get("acted_ts") or evicted["ts"]
    assert abs(acted - truth["requeue_ts"]) < 10.0, (evicted, truth)


def test_the_observed_run_would_have_been_evicted_like_the_evict_run() -> None:
    """The observe run, replayed under evict: node3 evicted after as long a slowdown as the
    live evict run's (the same job, the same fault), then never again; under observe, nothing
    but records."""
    evict_truth, _ = replay("demo-evict")
    truth, detections = replay("demo-observe")
    actions = [d["action"] for d in detections if d["kind"] == "straggler"]
    assert actions.count("evict") == 1, actions
    at = actions.index("evict")
    (evicted,) = [d for d in detections if d["action"] == "evict"]
    assert evicted["nodes"] == [truth["slow_node"]]
    live_s = evict_truth["requeue_ts"] - evict_truth["onset_ts"]
    assert abs((evicted.get("acted_ts") or evicted["ts"]) - truth["onset_ts"] - live_s) < 30.0
    later = [d for d in detections if d["kind"] == "straggler"][at + 1 :]
    assert later
    assert all(d["reasons"] == ["evicted from the job before"] for d in later)
    _, observed = replay("demo-observe", "observe")
    assert {d["action"] for d in observed} <= {"none", "report"}
    assert truth["decisions"]
    assert {d["action"] for d in truth["decisions"]} <= {"none", "report"}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("00:30:00", 1800.0),
        ("1-02:00:05", 93605.0),
        ("UNLIMITED", None),
        ("30", None),
        ("x-01:00:00", None),
        ("", None),
    ],
)
def test_slurm_time_limits(text: str, seconds: float | None) -> None:
    assert time_limit_s(text) == seconds
