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
from tests.scenarios.cluster import cluster_month
from tests.scenarios.scoring import oracle, score

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
