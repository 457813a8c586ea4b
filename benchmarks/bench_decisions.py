"""Evictions decided per scenario: what the shipped `evict` policy would do, replayed through
the backtest (the service's detector and decide(), on the trace's clock).

Jobs of 96 ranks on 12 nodes, ~1 s steps, 20 minutes each, no time limit (the backtest assumes
`assume_remaining_s`) and no checkpoints reported (a requeue loses the work since the start).
Per scenario: the reports, the jobs the replay decided to evict (the first eviction of each
job: the trace goes on as recorded, so a lasting straggler is evicted again after the cooldown),
whether the node was the slow one, and how long after the onset that eviction was decided.

``python -m benchmarks.bench_decisions [--quick]``
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks._common import machine, table
from slurm_plugin.backtest import run_backtest
from slurm_plugin.policy.loader import load_policies
from slurm_plugin.trace import read_trace
from tests.scenarios.generator import (
    JobSpec,
    Slowdown,
    burst,
    generate,
    pipeline,
    step_change,
    write_csv,
)

REPO = Path(__file__).resolve().parents[1]
WORLD, STEPS, ONSET = 96, 1200, 300
NODE1 = range(8, 16)  # the ranks of n0001


def _node(slow: Slowdown) -> dict[int, Slowdown]:
    return dict.fromkeys(NODE1, slow)


def scenarios() -> list[tuple[str, str | None, dict[int, Slowdown]]]:
    """(name, the node that should be evicted or None, compute slowdowns by rank)."""
    stages, _ = pipeline(WORLD, [0.0, 0.08, 0.25])
    return [
        ("healthy", None, {}),
        ("pipeline stages +8 % and +25 % (structure)", None, stages),
        ("a node 3x slow for 6 steps, then healthy", None, _node(burst(2.0, ONSET, 6))),
        ("a node 2x slow for 30 steps, then healthy", None, _node(burst(1.0, ONSET, 30))),
        ("a node 2x slow for 90 steps, then healthy", None, _node(burst(1.0, ONSET, 90))),
        ("one GPU +7 % from step 300 (lasting)", "n0002", {20: step_change(0.07, ONSET)}),
        ("a node 2x slow from step 300 (lasting)", "n0001", _node(step_change(1.0, ONSET))),
        ("a node 2x slow from step 0 (lasting)", "n0001", _node(step_change(1.0, 0))),
        (
            "pipeline stages and one GPU +7 % (lasting)",
            "n0002",
            {**stages, 20: step_change(0.07, ONSET)},  # rank 20: the first stage (+0 %)
        ),
    ]


def run(seeds: int) -> list[list[object]]:
    policy = load_policies(REPO / "policies")["evict"]
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, culprit, slow in scenarios():
            evicted_jobs, right, after_s, reports = 0, 0, [], 0
            for seed in range(seeds):
                spec = JobSpec("b", WORLD, STEPS, compute_s=0.9, seed=seed, compute_slow=slow)
                batch = generate(spec)
                path = Path(tmp) / "trace.csv"
                write_csv([("b", batch)], str(path))
                result = run_backtest(read_trace(path), policy)
                stragglers = [d for d in result.detections if d["kind"] == "straggler"]
                reports += len(stragglers)
                first = next((d for d in stragglers if d["action"] == "evict"), None)
                if first is None:
                    continue
                evicted_jobs += 1
                onset = 0 if "step 0" in name else ONSET
                if first["node"] == culprit:
                    right += 1
                    after_s.append(first["ts"] - float(batch.ts[batch.step == onset].min()))
            rows.append(
                [
                    name,
                    seeds,
                    reports,
                    evicted_jobs,
                    f"{right}/{evicted_jobs}" if evicted_jobs else "-",
                    f"{statistics.median(after_s):.0f}" if after_s else "-",
                ]
            )
    return rows


def main() -> None:
    seeds = 1 if "--quick" in sys.argv else 3
    print(f"# evictions decided per scenario ({machine()})")
    print(
        "policy: policies/evict.toml as shipped; 96 ranks on 12 nodes, 1200 steps of ~1 s "
        "(~2 s while a node is 2x slow); no checkpoints, no time limit"
    )
    print(
        table(
            ["scenario", "jobs", "reports", "jobs evicted", "right node", "after the onset, s"],
            run(seeds),
        )
    )


if __name__ == "__main__":
    main()
