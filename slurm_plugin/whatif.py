"""What a policy would have cost and saved on a trace, in GPU-hours (pure).

Everything comes from the replay's own detections, on the trace's clock:

- **lost to stragglers**: for every slowdown episode of a node in a job (its reports share a
  start), the share of the job's time the node cost it (the detector's what-if of the job's
  steps without the node) from the episode's start to its last report, times the job's GPUs
  (its ranks). This is what never evicting costs within the trace.
- **spent on evictions**: each eviction's restart and the work it lost (its decision inputs).
- **saved**: each eviction's episode from the eviction to its last report (the trace goes on
  as recorded, so a node that stayed slow shows what the eviction spared).

A trace ends where its records end: what a slowdown would have cost after that is not known
here and not counted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from slurm_plugin.trace import Trace


@dataclass(frozen=True)
class WhatIf:
    """One policy on one set of traces."""

    policy: str
    evictions: int
    persistent_nodes: int
    lost_gpu_h: float
    spent_gpu_h: float
    saved_gpu_h: float

    @property
    def net_gpu_h(self) -> float:
        """Saved less spent."""
        return self.saved_gpu_h - self.spent_gpu_h

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, GPU-hours rounded to 0.01."""
        data = asdict(self)
        for key in ("lost_gpu_h", "spent_gpu_h", "saved_gpu_h"):
            data[key] = round(data[key], 2)
        data["net_gpu_h"] = round(self.net_gpu_h, 2)
        return data


def gpus_per_job(trace: Trace) -> dict[str, int]:
    """Each job's GPUs: its distinct ranks."""
    if not len(trace):
        return {}
    pairs = np.unique(trace.job_code.astype(np.int64) * (int(trace.rank.max()) + 1) + trace.rank)
    counts = np.bincount(pairs // (int(trace.rank.max()) + 1), minlength=len(trace.job_names))
    return {name: int(n) for name, n in zip(trace.job_names, counts.tolist(), strict=True)}


def what_if(
    policy: str, detections: list[dict[str, Any]], persistent: list[str], trace: Trace
) -> WhatIf:
    """The figures of :mod:`slurm_plugin.whatif` for one replay."""
    gpus = gpus_per_job(trace)
    episodes: dict[tuple[str, str, float], list[dict[str, Any]]] = defaultdict(list)
    for d in detections:
        details = d.get("details") or {}
        if d.get("kind") != "straggler" or d.get("cause") != "compute":
            continue
        since = details.get("since_ts")
        episodes[(d["job_id"], d["node"], float(since if since is not None else d["ts"]))].append(d)
    lost = spent = saved = 0.0
    evictions = 0
    for (job, _, since), rows in episodes.items():
        shares = [
            float(r["details"]["job_loss_pct"])
            for r in rows
            if r["details"].get("job_loss_pct") is not None
        ]
        share = float(np.median(shares)) / 100.0 if shares else 0.0
        end = max(float(r["ts"]) for r in rows)
        lost += share * max(0.0, end - since) * gpus.get(job, 0) / 3600.0
        for r in rows:
            if r.get("action") != "evict":
                continue
            evictions += 1
            acted = float(r.get("acted_ts") or r["ts"])
            inputs = r.get("inputs") or {}
            cost = float(inputs.get("restart_cost_s", 0.0)) + float(inputs.get("lost_work_s", 0.0))
            spent += cost * gpus.get(job, 0) / 3600.0
            saved += share * max(0.0, end - acted) * gpus.get(job, 0) / 3600.0
    return WhatIf(policy, evictions, len(persistent), lost, spent, saved)
