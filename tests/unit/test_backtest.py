"""Trace parsing and `straggler backtest`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_plugin.backtest import run_backtest
from slurm_plugin.cli.main import cli
from slurm_plugin.policy.loader import load_policy
from slurm_plugin.policy.rails import PersistencePolicy
from slurm_plugin.policy.schema import Policy
from slurm_plugin.policy.verdict import UNKNOWN
from slurm_plugin.replay import Replay
from slurm_plugin.trace import read_trace
from slurm_plugin.trace_meta import read_context
from tests.scenarios.generator import JobSpec, burst, generate, step_change, write_csv

REPO = Path(__file__).resolve().parents[2]
HEADER = "job_id,rank,node,gpu,step,ts,step_s,compute_s,comm_s,data_s\n"


def test_backtest_json(tmp_path: Path) -> None:
    """The CLI prints the documented JSON with the straggler of the trace, the what-if
    report and the assumptions it made."""
    jobs = [
        ("31", generate(JobSpec("31", 64, 300, seed=2, compute_slow={12: step_change(0.25, 100)})))
    ]
    path = tmp_path / "t.csv"
    write_csv(jobs, str(path))
    result = CliRunner().invoke(cli, ["backtest", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"detections", "persistent_nodes", "report", "assumptions"}
    assert data["report"]["evictions"] == 0
    assert data["report"]["lost_gpu_h"] > 0  # a +25 % GPU among 64 cost the job time
    assert len(data["assumptions"]) == 2
    detection, *again = data["detections"]  # again: the same GPU, still slow, a minute on
    assert {k: detection[k] for k in ("job_id", "node", "rank", "gpu", "cause", "action")} == {
        "job_id": "31",
        "node": "n0001",
        "rank": 12,
        "gpu": 4,
        "cause": "compute",
        "action": "annotate",
    }
    # Seconds old: expected to pass (5 % that it lasts), not worth a requeue.
    assert detection["reasons"][0].startswith("goodput: evicting saves")
    assert "that it lasts" in detection["reasons"][0]
    assert {(d["node"], d["rank"]) for d in again} == {("n0001", 12)}
    assert detection["step"] >= 100
    assert data["persistent_nodes"] == []


def test_backtest_with_a_policy_file_and_a_typo(tmp_path: Path) -> None:
    """--policy reads a TOML policy; a typo in it is one clear error naming the key."""
    trace = tmp_path / "t.csv"
    trace.write_text(HEADER + "1,0,n1,0,0,100.0,0.1,0.1,0.0,\n")
    good = tmp_path / "observe.toml"
    good.write_text('[detection]\nmin_slowdown_pct = 5\n[actions]\nmode = "observe"\n')
    result = CliRunner().invoke(cli, ["backtest", str(trace), "--policy", str(good), "--json"])
    assert result.exit_code == 0, result.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[detection]\nmin_slowdwn_pct = 5\n")
    result = CliRunner().invoke(cli, ["backtest", str(trace), "--policy", str(bad)])
    assert result.exit_code == 2
    assert "detection.min_slowdwn_pct" in result.stderr
    assert str(bad) in result.stderr


def test_a_restart_inside_one_chunk_keeps_the_first_attempts_straggler(tmp_path: Path) -> None:
    """Issue 14: a job evicted and resumed from a checkpoint (same job id, steps going back)
    whose two attempts fall in one replay chunk: the first attempt's straggler is reported,
    nothing after the restart (the slow GPU is gone)."""
    first = generate(JobSpec("41", 64, 300, seed=8, compute_slow={12: step_change(0.06, 100)}))
    second = generate(JobSpec("41", 64, 200, seed=9, attempt=1, start_ts=1_700_000_400.0))
    second.step += 200  # resumed from the checkpoint at step 200
    path = tmp_path / "restart.csv"
    write_csv([("41", first), ("41", second)], str(path))
    result = CliRunner().invoke(cli, ["backtest", str(path), "--json"])
    assert result.exit_code == 0, result.output
    detections = json.loads(result.stdout)["detections"]
    assert {(d["rank"], d["details"]["attempt"]) for d in detections} == {(12, 0)}, detections
    assert 100 <= detections[0]["step"] < 300


def test_a_job_that_stops_inside_a_step_is_a_hang(tmp_path: Path) -> None:
    """Issue 14: job 51's records end inside step 150 (rank 5 never reports it) while job 52
    goes on for twenty minutes: the backtest reports the hang, naming rank 5 and its node;
    job 52, which simply runs, has none."""
    hung = generate(JobSpec("51", 64, 151, seed=10))
    hung = hung.take(~((hung.step == 150) & (hung.rank == 5)))
    other = generate(JobSpec("52", 16, 2000, seed=12))
    path = tmp_path / "hang.csv"
    write_csv([("51", hung), ("52", other)], str(path))
    result = CliRunner().invoke(cli, ["backtest", str(path), "--json"])
    assert result.exit_code == 0, result.output
    hangs = [d for d in json.loads(result.stdout)["detections"] if d["kind"] == "hang"]
    assert [(d["job_id"], d["rank"], d["node"], d["step"]) for d in hangs] == [
        ("51", 5, "n0000", 149)
    ], hangs


def _companions(path: Path, jobs: dict[str, tuple[float, float | None]], every_s: float) -> None:
    """TRACE.jobs.csv and TRACE.events.csv beside ``path``: each job's start and time limit,
    and a checkpoint_end every ``every_s`` seconds of its first hour."""
    lines = ["job_id,start_ts,end_limit_ts"]
    lines += [f"{j},{start},{'' if end is None else end}" for j, (start, end) in jobs.items()]
    (path.parent / f"{path.stem}.jobs.csv").write_text("\n".join(lines) + "\n")
    events = ["job_id,ts,name"]
    for j, (start, _) in jobs.items():
        events += [f"{j},{start + k * every_s},checkpoint_end" for k in range(1, 3600 // 60)]
    (path.parent / f"{path.stem}.events.csv").write_text("\n".join(events) + "\n")


def test_the_actions_are_the_services_decisions(tmp_path: Path) -> None:
    """Issue 14 and 24: the backtest's action comes from decide() on the trace's clock, with
    the jobs' time limits and checkpoints from the trace's companions. A +5 % GPU among 64
    does not pay for a requeue (the job's step barely waits for it: goodput from the job's
    what-if); a +30 % one is reported every 30 s, not evicted while it may still pass, then
    waits for the job's next checkpoint once it has lasted long enough to be a fault, is
    evicted at that checkpoint (no work lost), and is out of the job after that (the trace
    goes on as recorded); a policy that only observes records."""
    small = generate(JobSpec("61", 64, 300, seed=2, compute_slow={12: step_change(0.05, 100)}))
    large = generate(
        JobSpec("62", 64, 2000, seed=3, compute_slow={40: step_change(0.30, 50)}, start_ts=1.7e9)
    )
    path = tmp_path / "t.csv"
    write_csv([("61", small), ("62", large)], str(path))
    starts = {"61": float(small.ts.min()) - 1, "62": float(large.ts.min()) - 1}
    _companions(path, {j: (t, t + 10 * 3600) for j, t in starts.items()}, every_s=60.0)
    result = CliRunner().invoke(cli, ["backtest", str(path), "--json"])
    assert result.exit_code == 0, result.output
    everything = json.loads(result.stdout)["detections"]
    # A slowdown is first reported while its rank's smoothed level still builds up: it does
    # not stand out from the other ranks' yet, and nothing is done (a few steps at most).
    early = [d for d in everything if "does not stand out" in d["reasons"][0]]
    assert all(d["action"] == "none" for d in early)
    assert all(d["step"] <= 100 + 40 for d in early if d["job_id"] == "61"), early
    assert all(d["step"] <= 50 + 20 for d in early if d["job_id"] == "62"), early
    detections = [d for d in everything if d not in early]
    rows = {d["job_id"]: d for d in reversed(detections)}  # each job's first
    assert rows["61"]["action"] == "annotate"
    assert rows["61"]["inputs"]["share_from"] == "the job's steps without the node"
    assert rows["61"]["inputs"]["share_pct"] < 2.0  # a +5 % GPU costs the job far less
    assert rows["61"]["saved_s"] < rows["61"]["cost_s"]
    reports = [d for d in detections if d["job_id"] == "62"]
    actions = [d["action"] for d in reports]
    evicted = actions.index("evict")
    assert set(actions[:evicted]) == {"annotate"}
    young = [d["reasons"][0].split(":")[0] for d in reports[:evicted]]
    assert young[0] == "not sure it lasts"  # seconds old: expected to pass
    assert [d["lasting_p"] for d in reports[:evicted]] == sorted(
        d["lasting_p"] for d in reports[:evicted]
    )
    chosen = reports[evicted]
    assert chosen["inputs"]["remaining_from"] == "time limit"
    assert chosen["inputs"]["share_pct"] > 10.0
    assert chosen["lasting_p"] >= 0.6
    assert chosen["saved_s"] > chosen["cost_s"]
    assert chosen["after"] == "checkpoint"  # waited for the next checkpoint: no work lost
    assert 0 < chosen["waited_s"] <= 60.0
    checkpoints = {starts["62"] + k * 60.0 for k in range(1, 60)}
    assert round(chosen["acted_ts"], 3) in {round(t, 3) for t in checkpoints}
    later = reports[evicted + 1 :]
    assert later
    assert all(d["reasons"] == ["evicted from the job before"] for d in later)
    assert all(d["action"] == "none" for d in later)
    observe = CliRunner().invoke(
        cli, ["backtest", str(path), "--json", "--policy", str(REPO / "policies/observe.toml")]
    )
    assert {d["action"] for d in json.loads(observe.stdout)["detections"]} == {"none"}


def test_without_companions_the_replay_states_its_assumptions(tmp_path: Path) -> None:
    """Issue 24 item 4: without TRACE.jobs.csv and TRACE.events.csv the backtest says what
    it assumed (no time limit, no checkpoints); with them it says nothing of the kind, and a
    companion with a bad number is one error naming the file, line and column."""
    batch = generate(JobSpec("7", 16, 100, seed=1))
    path = tmp_path / "t.csv"
    write_csv([("7", batch)], str(path))
    bare = CliRunner().invoke(cli, ["backtest", str(path)])
    assert bare.exit_code == 0, bare.output
    assert "no TRACE.jobs.csv" in bare.output
    assert "no checkpoint_end" in bare.output
    _companions(path, {"7": (float(batch.ts.min()), None)}, every_s=60.0)
    told = CliRunner().invoke(cli, ["backtest", str(path)])
    assert told.exit_code == 0, told.output
    assert "assumed" not in told.output
    (tmp_path / "t.jobs.csv").write_text("job_id,start_ts,end_limit_ts\n7,x,\n")
    bad = CliRunner().invoke(cli, ["backtest", str(path)])
    assert bad.exit_code != 0
    assert "t.jobs.csv: line 2, start_ts: not a finite number: 'x'" in bad.output


def test_a_burst_of_six_steps_is_reported_and_never_evicted(tmp_path: Path) -> None:
    """Issue 14: a node 3x slow for 6 steps (~1 s each), then healthy, in a 10-minute job:
    the backtest reports it and, with the shipped `evict` policy, decides no eviction."""
    slow = dict.fromkeys(range(8, 16), burst(2.0, 200, 6))
    batch = generate(JobSpec("71", 64, 600, compute_s=0.9, seed=4, compute_slow=slow))
    path = tmp_path / "burst.csv"
    write_csv([("71", batch)], str(path))
    result = CliRunner().invoke(
        cli, ["backtest", str(path), "--json", "--policy", str(REPO / "policies/evict.toml")]
    )
    assert result.exit_code == 0, result.output
    detections = [d for d in json.loads(result.stdout)["detections"] if d["kind"] == "straggler"]
    assert {d["node"] for d in detections} == {"n0001"}, detections
    assert [d["action"] for d in detections] == ["annotate"] * len(detections)
    assert detections[0]["lasted_s"] < 15  # seconds old when reported


def test_ranks_beyond_their_jobs_nodes_are_dropped_as_the_service_does(tmp_path: Path) -> None:
    """A record claiming rank 10**12 on a one-node job is dropped before detection (the
    service's rank_out_of_range rule) and counted; the rest replays as before."""
    jobs = [("7", generate(JobSpec("7", 32, 200, seed=5, compute_slow={3: step_change(0.3, 80)})))]
    path = tmp_path / "t.csv"
    write_csv(jobs, str(path))
    clean = CliRunner().invoke(cli, ["backtest", str(path), "--json"])
    with path.open("a") as handle:
        handle.write("7,1000000000000,n0000,0,5,1700000005.0,1.0,0.5,0.1,0.0\n")
    trace = read_trace(path)
    result = run_backtest(trace, Policy.model_validate({"name": "b", "actions": {"mode": "evict"}}))
    assert result.out_of_range == 1
    shown = json.loads(clean.stdout)
    assert result.to_dict() == {k: shown[k] for k in ("detections", "persistent_nodes")}
    only_bad = tmp_path / "bad.csv"
    only_bad.write_text(HEADER + "7,1000000000000,n0000,0,5,1700000005.0,1.0,0.5,0.1,0.0\n")
    empty = run_backtest(read_trace(only_bad), Policy(name="b"))
    assert (empty.out_of_range, empty.detections) == (1, [])


def test_the_what_if_report_compares_policies_over_a_directory(tmp_path: Path) -> None:
    """Issue 24 item 5: a directory of two exported traces (each with its companions) under
    `evict` and `observe`: per policy the GPU-hours lost, spent and saved and the evictions.
    Both lose the same to the stragglers had nothing been done; observing saves nothing;
    evicting the lasting +30 % GPU of the job
    with 10 hours left saves more than it spends within its 50-minute trace. The same GPU in
    a job whose time limit ends 20 minutes after its start is never evicted (what is left
    could not pay for the requeue)."""
    traces = tmp_path / "traces"
    traces.mkdir()
    for job, limit_h, steps in (("71", 10.0, 5000), ("72", 1 / 3, 1500)):
        batch = generate(
            JobSpec(job, 64, steps, seed=int(job), compute_slow={40: step_change(0.30, 50)})
        )
        path = traces / f"job-{job}.csv"
        write_csv([(job, batch)], str(path))
        start = float(batch.ts.min()) - 1
        _companions(path, {job: (start, start + limit_h * 3600)}, every_s=60.0)
    argv = ["backtest", str(traces), "--json"]
    for name in ("evict", "observe"):
        argv += ["--policy", str(REPO / "policies" / f"{name}.toml")]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["assumptions"] == []
    runs = {p["policy"]: p for p in data["policies"]}
    evict, observe = runs["evict"]["report"], runs["observe"]["report"]
    assert (observe["evictions"], observe["saved_gpu_h"], observe["spent_gpu_h"]) == (0, 0, 0)
    assert evict["evictions"] == 1
    assert evict["saved_gpu_h"] > evict["spent_gpu_h"] > 0
    assert evict["lost_gpu_h"] == observe["lost_gpu_h"] > 0  # never evicting: the baseline
    evicted = {d["job_id"] for d in runs["evict"]["detections"] if d["action"] == "evict"}
    assert evicted == {"71"}
    text = CliRunner().invoke(cli, [a for a in argv if a != "--json"])
    assert text.exit_code == 0, text.output
    assert "evict" in text.output
    assert "observe" in text.output
    assert "SAVED_GPU_H" in text.output


@pytest.mark.parametrize(("recent", "why"), [(0.0, "recovered, not evicted"), (None, UNKNOWN)])
def test_the_backtest_takes_the_services_final_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recent: float | None, why: str
) -> None:
    """Issue 25 item 2: the replay's eviction goes through the service's final verdict
    (policy/verdict.py) with the re-check on the trace: a node back to its peers' pace is not
    evicted (the service's half-the-minimum rule); nothing to re-check waits a cycle and is
    decided again, never read as "recovered"."""
    large = generate(
        JobSpec("62", 64, 2000, seed=3, compute_slow={40: step_change(0.30, 50)}, start_ts=1.7e9)
    )
    path = tmp_path / "t.csv"
    write_csv([("62", large)], str(path))
    start = float(large.ts.min()) - 1
    _companions(path, {"62": (start, start + 10 * 3600)}, every_s=60.0)
    monkeypatch.setattr(Replay, "_recent_slowdown_pct", lambda *_a, **_k: recent)
    result = CliRunner().invoke(cli, ["backtest", str(path), "--json"])
    assert result.exit_code == 0, result.output
    detections = json.loads(result.stdout)["detections"]
    assert [d for d in detections if d["action"] == "evict"] == []
    held_back = [d for d in detections if any(why in r for r in d["reasons"])]
    assert held_back, [d["reasons"] for d in detections]
    if recent is None:  # waited on the re-check, cycle after cycle, to the trace's end
        assert all(d["action"] == "wait" for d in held_back)
        assert held_back[0]["waiting_for"] == "recheck"


def test_a_node_slow_from_the_first_step_is_evicted_as_the_service_would(tmp_path: Path) -> None:
    """Issue 24/25: the replay's re-check divides out only what the job's detector took for
    structure, as the service's re-check does. A node +50 % from the job's first step is a
    fault (evicted at a checkpoint once it pays, the re-check seeing it still slow), while the
    last GPU of every node, +20 % by design, is structure and never evicted. (Measured against
    the job's own first steps, the fault read as "recovered" and was never evicted: the
    cluster month's saving fell from ~90 % of the oracle's to ~10 %.)"""
    slow = {r: step_change(0.20, 0) for r in range(7, 64, 8)}
    slow.update({r: step_change(0.50, 0) for r in range(40, 48)})
    batch = generate(JobSpec("63", 64, 2000, seed=5, compute_slow=slow, start_ts=1.7e9))
    path = tmp_path / "t.csv"
    write_csv([("63", batch)], str(path))
    start = float(batch.ts.min()) - 1
    _companions(path, {"63": (start, start + 10 * 3600)}, every_s=60.0)
    result = CliRunner().invoke(
        cli, ["backtest", str(path), "--json", "--policy", str(REPO / "policies/evict.toml")]
    )
    assert result.exit_code == 0, result.output
    detections = [d for d in json.loads(result.stdout)["detections"] if d["kind"] == "straggler"]
    evicted = [d for d in detections if d["action"] == "evict"]
    assert [d["node"] for d in evicted] == ["n0005"], [
        (d["node"], d["action"], d["reasons"]) for d in detections
    ]
    assert not any("recovered" in r for d in detections for r in d["reasons"])


def test_evictions_go_into_node_history_as_the_service_records_them(tmp_path: Path) -> None:
    """Issue 36, class 5: a node +60 % in two jobs two hours apart, under a persistence
    setting where no report is ever long enough to be an incident (``sustained_s`` an hour):
    the first job evicts it once the slowdown pays (~14 minutes in), and that eviction is an
    incident of the node, so the second job, knowing it, evicts it a minute in; the two
    evictions make it persistent. Without evictions (observe) it stays unmarked."""
    slow = {r: step_change(0.60, 30) for r in range(16, 24)}
    jobs = [
        (j, generate(JobSpec(j, 64, 1200, seed=s, start_ts=1.7e9 + k * 7200, compute_slow=slow)))
        for k, (j, s) in enumerate((("71", 1), ("72", 2)))
    ]
    path = tmp_path / "t.csv"
    write_csv(jobs, str(path))
    starts = {j: float(b.ts.min()) - 1 for j, b in jobs}
    _companions(path, {j: (t, t + 10 * 3600) for j, t in starts.items()}, every_s=20.0)
    trace, context = read_trace(path), read_context(path)
    hourly = PersistencePolicy(sustained_s=3600.0)
    result = run_backtest(trace, load_policy(REPO / "policies/evict.toml"), hourly, context=context)
    evicted = [d for d in result.detections if d["action"] == "evict"]
    assert [(d["job_id"], d["node"]) for d in evicted] == [("71", "n0002"), ("72", "n0002")]
    first, second = (d["ts"] - starts[d["job_id"]] for d in evicted)
    assert second < 120
    assert first > 600
    assert evicted[1]["lasting_p"] >= 0.6  # the node slow in another job: likely a fault
    assert result.persistent_nodes == ["n0002"]
    observe = load_policy(REPO / "policies/observe.toml")
    assert run_backtest(trace, observe, hourly, context=context).persistent_nodes == []


def test_gpus_that_may_be_a_stage_of_a_two_node_job_wait_for_another_jobs_word(
    tmp_path: Path,
) -> None:
    """Issue 36, class 6: GPUs 6-7 of a two-node job's second node, +30 % from its first
    step and no labels, may be a pipeline stage laid over them: the replay notes them and
    never evicts, and they do not count in node history (the same job run again, "82" on
    the same nodes, does not evict either). A 64-GPU job then sees that node slow as a whole
    (+60 % from step 30): evicted, an incident. The next two-node job with those GPUs slow
    from the start has another job's word on the node: evicted."""
    block = dict.fromkeys(range(14, 16), step_change(0.30, 0))
    small = ["n0000", "n0001"]
    big = [f"n{i:04d}" for i in (1, 2, 3, 4, 5, 6, 7, 8)]
    whole = dict.fromkeys(range(8), step_change(0.60, 30))
    specs = [
        JobSpec("81", 16, 900, nodes=small, seed=1, compute_slow=block),
        JobSpec("82", 16, 900, nodes=small, seed=2, compute_slow=block),
        JobSpec("83", 64, 1500, nodes=big, seed=3, compute_slow=whole),
        JobSpec("84", 16, 900, nodes=small, seed=4, compute_slow=block),
    ]
    jobs = [
        (s.job_id, generate(replace(s, start_ts=1.7e9 + k * 7200))) for k, s in enumerate(specs)
    ]
    path = tmp_path / "t.csv"
    write_csv(jobs, str(path))
    starts = {j: float(b.ts.min()) - 1 for j, b in jobs}
    _companions(path, {j: (t, t + 10 * 3600) for j, t in starts.items()}, every_s=20.0)
    trace, context = read_trace(path), read_context(path)
    result = run_backtest(trace, load_policy(REPO / "policies/evict.toml"), context=context)
    stragglers = [d for d in result.detections if d["kind"] == "straggler"]
    evicted = [(d["job_id"], d["node"]) for d in stragglers if d["action"] == "evict"]
    assert evicted == [("83", "n0001"), ("84", "n0001")], [
        (d["job_id"], d["node"], d["action"], d["reasons"][:1]) for d in stragglers
    ]
    waited = [d for d in stragglers if d["job_id"] in {"81", "82"} and d["node"] == "n0001"]
    assert waited
    assert all(d["action"] == "annotate" for d in waited)
    assert any("waiting for another job's word" in r for d in waited for r in d["reasons"])


def test_a_slowdown_from_the_start_that_comes_back_after_the_requeue_is_the_jobs_own(
    tmp_path: Path,
) -> None:
    """Issue 36, class 6: a two-node job without labels whose second node is +40 % from its
    first step (a fault, or a pipeline stage that fills that node: nothing tells) is evicted
    (the cheaper mistake). Its next attempt, on another node, is +40 % from its first step
    again: the job's own design, never evicted again."""
    slow = dict.fromkeys(range(8, 16), step_change(0.40, 0))
    first = generate(
        JobSpec("91", 16, 3000, nodes=["n0000", "n0001"], seed=1, compute_slow=slow, start_ts=1.7e9)
    )
    again = JobSpec("91", 16, 3000, nodes=["n0000", "n0002"], seed=2, compute_slow=slow)
    second = generate(replace(again, attempt=1, start_ts=float(first.ts.max()) + 300.0))
    second.step += 1000  # resumed from its checkpoint at step 1000
    path = tmp_path / "t.csv"
    write_csv([("91", first), ("91", second)], str(path))
    start = float(first.ts.min()) - 1
    _companions(path, {"91": (start, start + 20 * 3600)}, every_s=20.0)
    trace, context = read_trace(path), read_context(path)
    result = run_backtest(trace, load_policy(REPO / "policies/evict.toml"), context=context)
    stragglers = [d for d in result.detections if d["kind"] == "straggler"]
    evicted = [(d["node"], d["details"]["attempt"]) for d in stragglers if d["action"] == "evict"]
    assert evicted == [("n0001", 0)], [(d["node"], d["action"], d["reasons"]) for d in stragglers]
    back = [d for d in stragglers if d["node"] == "n0002"]
    assert back
    assert all(d["action"] != "evict" for d in back)
    assert any("requeued from attempt 0" in r for d in back for r in d["reasons"])
