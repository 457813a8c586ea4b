"""A simulated cluster month, replayed under a policy and scored against the truth.

The month (``tests/scenarios/cluster.py``): 16,384 GPUs, jobs of 8 to 4,096 GPUs with 0.5-30 s
steps, persistent faults, fail-slow episodes, bursts, pipeline / GPU-position / MoE /
sequence-length / mixed-GPU structure with and without labels, input-bound ranks, hangs, sync
stalls and restarts. Each job's trace window is replayed by ``run_backtest`` with its
companions (time limits, checkpoints), exactly as ``straggler backtest`` would, and every
eviction and persistent node is scored in GPU-hours (``tests/scenarios/scoring.py``) beside
never evicting and an oracle that evicts exactly when it pays. Each month runs under both
noise models (``gauss``, the one the policy was tuned on, and ``heavy``, held out), and the
worst month of each policy is quoted at the end (its share of the oracle's net saving).

``python -m benchmarks.bench_cluster [--quick] [--seeds N] [--first-seed K] [--jobs N]
[--policy FILE ...] [--noise gauss|heavy ...]``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks._common import machine, table
from slurm_plugin.backtest import run_backtest
from slurm_plugin.policy.loader import load_policy
from tests.scenarios.cluster import NOISE_MODELS, cluster_month
from tests.scenarios.scoring import Score, never_lost, oracle, score, unmarked_why

REPO = Path(__file__).resolve().parents[1]


def _ett(lost_gpu_h: float, total_gpu_h: float) -> str:
    """The straggler part of the month's effective training time: the share of its jobs'
    GPU-hours not lost to stragglers or spent on evictions."""
    return f"{1.0 - lost_gpu_h / total_gpu_h:.4f}" if total_gpu_h > 0 else "-"


def _row(name: str, s: Score, best: float, total: float) -> list[object]:
    share = f"{100 * s.net_gpu_h / best:.0f} %" if best > 0 else "-"
    return [
        name,
        s.evictions,
        s.needless,
        s.not_paying,
        len(s.wrong_persistent),
        len(s.bad_unmarked),
        len(s.missed),
        f"{s.lost_gpu_h:,.0f}",
        f"{s.spent_gpu_h:,.0f}",
        f"{s.saved_gpu_h:,.0f}",
        share,
        _ett(s.lost_gpu_h, total),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one month of 40 short jobs")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="months from this seed on")
    parser.add_argument("--jobs", type=int, default=120)
    parser.add_argument("--policy", type=Path, action="append", default=[])
    parser.add_argument("-v", "--verbose", action="store_true", help="list what went wrong")
    parser.add_argument(
        "--noise", action="append", choices=NOISE_MODELS, default=[], help="default: both"
    )
    args = parser.parse_args()
    seeds, jobs, scale = (1, 40, 0.5) if args.quick else (args.seeds, args.jobs, 1.0)
    policies = [load_policy(p) for p in args.policy or [REPO / "policies" / "evict.toml"]]
    print(f"# a cluster month, scored ({machine()})")
    header = [
        "seed / policy",
        "evictions",
        "needless",
        "not paying",
        "healthy nodes persistent",
        "bad nodes unmarked",
        "sustained missed",
        "GPU-h lost to stragglers",
        "GPU-h spent evicting",
        "GPU-h saved",
        "of the oracle's net saving",
        "effective training time (stragglers)",
    ]
    rows: list[list[object]] = []
    worst: dict[str, tuple[float, str]] = {}
    below: dict[str, list[str]] = {}  # months where a policy's effective time is under never
    months = [
        (seed, noise)
        for noise in args.noise or NOISE_MODELS
        for seed in range(args.first_seed, args.first_seed + seeds)
    ]
    for seed, noise in months:
        started = time.perf_counter()
        month = cluster_month(seed, jobs, scale, noise)
        made = time.perf_counter() - started
        best = oracle(month)
        total = sum(j.gpu_hours(j.end_ts - j.start_ts) for j in month.jobs)
        never = never_lost(month)
        lost = f"{never:,.0f}"
        rows.append([f"{seed} {noise} never evict", 0, 0, 0, 0, "-", "-", lost, 0, 0, "0 %"])
        rows[-1].append(_ett(never, total))
        for policy in policies:
            started = time.perf_counter()
            result = run_backtest(month.trace, policy, context=month.context)
            replayed = time.perf_counter() - started
            scored = score(month, result.to_dict())
            rows.append(_row(f"{seed} {noise} {policy.name}", scored, best.net_gpu_h, total))
            if scored.lost_gpu_h > never:
                below.setdefault(policy.name, []).append(f"seed {seed} {noise}")
            if best.net_gpu_h > 0:
                share = 100 * scored.net_gpu_h / best.net_gpu_h
                if share < worst.get(policy.name, (float("inf"), ""))[0]:
                    worst[policy.name] = (share, f"seed {seed} {noise}")
            gpus = sum(j.world for j in month.jobs)
            print(
                f"seed {seed} ({noise} noise): {len(month.jobs)} jobs, {gpus:,} GPUs in all, "
                f"{len(month.trace):,} records (made in {made:.1f} s, replayed under "
                f"{policy.name} in {replayed:.1f} s)"
            )
            if args.verbose:
                for what, items in (
                    ("needless", scored.needless_list),
                    ("healthy persistent", scored.wrong_persistent),
                    ("missed", scored.missed),
                    ("bad unmarked", scored.bad_unmarked),
                ):
                    for item in items:
                        print(f"  {what}: {item}")
                for node in scored.bad_unmarked:
                    print(f"    {node}: {unmarked_why(month, node, result.to_dict())}")
        rows.append(_row(f"{seed} {noise} oracle", best, best.net_gpu_h, total))
    print(table(header, rows))
    for name, (share, month_name) in worst.items():
        print(f"worst month under {name}: {month_name}, {share:.0f} % of the oracle's net saving")
    for policy in policies:
        months_below = below.get(policy.name, [])
        print(
            f"months where {policy.name}'s effective training time is below never evicting: "
            f"{', '.join(months_below) if months_below else 'none'}"
        )


if __name__ == "__main__":
    main()
