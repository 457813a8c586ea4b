"""Issue 24's goal held by a test, not only a benchmark: a short cluster month (40 jobs of
``tests/scenarios/cluster.py``, every fault and structure class), replayed under the shipped
`evict` policy with its companions and scored against the truth. A change anywhere on the
decision path (detection, structure, the what-if, the re-check, the final verdict) that makes
an eviction needless, a healthy node persistent, misses a sustained slowdown or gives away the
saving fails here. (Once, the replay's re-check measured a node against the job's own first
steps: a node slow from the first step read "recovered" and the month's saving fell from ~90 %
of the oracle's to ~10 %, with every unit test green.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_plugin.backtest import run_backtest
from slurm_plugin.policy.loader import load_policy
from tests.scenarios.cluster import JobTruth, Month, Slowdown, cluster_month
from tests.scenarios.scoring import oracle, score, unmarked, unmarked_why

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_short_month_under_the_shipped_evict_policy(seed: int) -> None:
    month = cluster_month(seed, 40, 0.5)
    result = run_backtest(
        month.trace, load_policy(REPO / "policies" / "evict.toml"), context=month.context
    )
    scored, best = score(month, result.to_dict()), oracle(month)
    assert scored.needless_list == []
    assert scored.wrong_persistent == []
    assert scored.missed == []
    assert best.net_gpu_h > 0
    assert scored.net_gpu_h >= 0.8 * best.net_gpu_h, (scored, best.net_gpu_h)


def test_an_unmarked_bad_node_says_what_each_of_its_jobs_saw() -> None:
    """The benchmark's `bad unmarked` line tells a node no timing could see (its slowdown
    cost the job nothing) from one a decision missed: per job, the slowdown, its share of
    the job's time and whether the job was evicted from it."""

    def job(job_id: str, extra: float, loss: float) -> JobTruth:
        truth = JobTruth(
            job_id=job_id,
            world=16,
            nodes=["n0001", "n0002"],
            start_ts=0.0,
            trace_end_ts=3600.0,
            end_ts=7200.0,
            limit_ts=None,
            step_s=1.0,
            checkpoint_s=600.0,
            reports_checkpoints=True,
            restart_s=60.0,
            structure="pipeline",
            labelled=False,
        )
        truth.slowdowns.append(Slowdown("persistent", "n0001", (3,), extra, 100.0, 7200.0, loss))
        return truth

    month = Month([job("1", 0.3, 0.2), job("2", 0.09, 0.0)], None, None, {"n0001"})  # type: ignore[arg-type]
    result = {
        "detections": [
            {"kind": "straggler", "action": "evict", "job_id": "1", "node": "n0001"},
            {"kind": "straggler", "action": "annotate", "job_id": "2", "node": "n0001"},
        ],
        "persistent_nodes": [],
    }
    assert unmarked(month, set()) == ["n0001"]
    assert unmarked_why(month, "n0001", result) == (
        "job 1 persistent +30% on 1 of 16 ranks pipeline, costs the job 20.0%, evicted; "
        "job 2 persistent +9% on 1 of 16 ranks pipeline, costs the job 0.0%"
    )
