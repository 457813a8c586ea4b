"""Issue 36, class 7: bad nodes from the first step are not taken for structure when other
jobs saw them slow. Two whole nodes slow by the same amount from a job's first step look like
a stage of the job's own (another GPU model, a pipeline stage on two nodes) and are compared
with themselves from then on: in a pool where the same two nodes serve job after job, none of
those jobs ever reports them. Node history tells them apart: a node other jobs saw slow
lately is never structure on its own (`Detector.suspect`, from `policy.history.slow_elsewhere`
in the service and in the backtest), while a stage shared with a node of the job's own stays
a stage."""

from __future__ import annotations

from pathlib import Path

from slurm_plugin.backtest import run_backtest
from slurm_plugin.detection import Detector, StragglerEvent
from slurm_plugin.model.batch import RecordBatch
from slurm_plugin.policy.history import HistoryParams, Incident, NodeHistory, slow_elsewhere
from slurm_plugin.policy.loader import load_policy
from slurm_plugin.trace import read_trace
from tests.scenarios.decisions import REPO
from tests.scenarios.generator import JobSpec, generate, pipeline, step_change, write_csv

BAD = ("n0003", "n0011")
#: A 128-GPU job (16 nodes) with two whole nodes +30 % from its first step.
SLOW_FROM_START = {r: step_change(0.30, 0) for n in (3, 11) for r in range(8 * n, 8 * n + 8)}

WORLD = 96  # 12 nodes of 8 GPUs; three stages of four nodes each (as test_structure.py)


def _stragglers(batch: RecordBatch, job: str, suspect: tuple[str, ...]) -> set[str]:
    det = Detector()
    det.suspect(job, suspect)
    det.add(job, batch)
    return {e.node for e in det.advance(final=True) if isinstance(e, StragglerEvent)}


def test_two_nodes_slow_from_the_first_step_are_found_when_other_jobs_saw_them_slow() -> None:
    """Unknown, the two nodes are a stage of the job's (nothing reported: what the class
    measured); slow in other jobs, both are reported and nothing else."""
    batch = generate(JobSpec("j", 128, 600, seed=3, compute_slow=SLOW_FROM_START))
    assert _stragglers(batch, "j", ()) == set()
    assert _stragglers(batch, "j", BAD) == set(BAD)


def test_a_stage_shared_with_a_node_of_the_jobs_own_stays_a_stage() -> None:
    """A node once slow elsewhere that holds a stage with nodes the job has to itself is that
    stage: the healthy pipeline reports nothing (the +25 % stage's first node suspect), nor
    does another GPU model on two nodes when one of them is suspect."""
    slow, _ = pipeline(WORLD, [0.0, 0.08, 0.25])
    batch = generate(JobSpec("p", WORLD, 500, seed=11, compute_slow=slow))
    assert _stragglers(batch, "p", ("n0008",)) == set()
    sku = {r: step_change(0.15, 0) for r in range(16, 32)}
    batch = generate(JobSpec("s", 64, 400, seed=5, compute_slow=sku))
    assert _stragglers(batch, "s", ("n0002",)) == set()


def test_slow_elsewhere_counts_other_jobs_within_the_window() -> None:
    """A job's own incidents, and incidents older than ``recent_s`` (7 days; still in the
    persistence window of 14), make no node suspect: with the window for both, healthy nodes
    of structured jobs were evicted on the month benchmark (a passing episode days earlier
    made their stage's offset a fault)."""
    params = HistoryParams()
    now = 1_700_000_000.0
    assert params.recent_s < params.window_s
    histories = [
        NodeHistory("a", (Incident("other", now - 3600.0),)),
        NodeHistory("b", (Incident("me", now - 60.0),)),
        NodeHistory("c", (Incident("other", now - params.recent_s - 1.0),)),
        NodeHistory("d", (Incident("other", now - 60.0, cause="input"),)),
        NodeHistory("e"),
    ]
    assert slow_elsewhere(histories, "me", now, params) == ["a"]


def _job(job: str, start: float, steps: int, onset: int) -> tuple[str, RecordBatch]:
    slow = {r: step_change(0.30, onset) for n in (3, 11) for r in range(8 * n, 8 * n + 8)}
    return job, generate(JobSpec(job, 128, steps, start_ts=start, seed=7, compute_slow=slow))


def test_the_backtest_finds_them_in_the_next_job_and_marks_them(tmp_path: Path) -> None:
    """The month's shape in two jobs of one pool: the first sees the two nodes go slow at
    step 150 (found, incidents); the next starts on them slow from its first step and, told
    by the node history built while replaying, reports them too: both persistent (two jobs).
    The second job alone reports nothing (the class as measured)."""
    policy = load_policy(REPO / "policies" / "observe.toml")
    first = _job("101", 1_700_000_000.0, 1200, 150)
    second = _job("102", 1_700_000_000.0 + 1200.0, 1000, 0)
    both, alone = tmp_path / "both.csv", tmp_path / "alone.csv"
    write_csv([first, second], str(both))
    write_csv([second], str(alone))

    result = run_backtest(read_trace(both), policy)
    found = {(d["job_id"], d["node"]) for d in result.detections if d["kind"] == "straggler"}
    assert found == {(j, n) for j in ("101", "102") for n in BAD}, found
    assert result.persistent_nodes == sorted(BAD)

    result = run_backtest(read_trace(alone), policy)
    assert [d for d in result.detections if d["kind"] == "straggler"] == []
