"""What the stragglers cost and what the service did about it, in GPU-hours, for the metrics
(the operators' dashboard: contrib/grafana/).

A job's GPUs are counted as its reporting ranks (one rank per GPU, as every stack we time
runs); a job whose ranks are not known yet counts as one. Three figures, each a counter:

- **lost**: the job time a straggling node cost while it lasted (how long it had lasted x the
  share of the job's step time it costs x the job's GPUs), counted once per second of it
  however often the detection is decided again;
- **spent**: what each eviction cost (the restart and the work since the last checkpoint);
- **saved**: what each eviction is expected to save (the goodput rule's estimate: the
  node's share of the job's remaining time).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurm_plugin.detection import StragglerEvent
    from slurm_plugin.policy.decide import Decision
    from slurm_plugin.service.metrics import Metrics
    from slurm_plugin.service.state import ServiceState

HOUR_S = 3600.0


class Value:
    """GPU-hours lost to stragglers, spent and saved by evictions; the service's own state
    (leading, paused, breaker) as gauges."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._ranks: dict[str, int] = {}
        self._counted: dict[tuple[str, str], float] = {}  # (job, node) -> lasted_s counted

    def saw(self, job_id: str, ranks: int) -> None:
        """The job's ranks that reported this cycle (the most seen is its GPU count)."""
        if ranks > self._ranks.get(job_id, 0):
            self._ranks[job_id] = ranks

    def gpus(self, job_id: str) -> int:
        return max(1, self._ranks.get(job_id, 0))

    def straggling(self, event: StragglerEvent, decision: Decision) -> None:
        """A slowdown decided on: its node flagged, the job time it cost since last counted."""
        self.metrics.node_flags.labels(node=event.node, cause=event.cause).inc()
        lasted = decision.lasted_s if decision.lasted_s is not None else event.lasted_s
        share = event.job_loss_pct if event.job_loss_pct is not None else event.slowdown_pct
        key = (event.job_id, event.node)
        before = self._counted.get(key, 0.0)
        if lasted <= before:
            return
        self._counted[key] = lasted
        lost = (lasted - before) * max(0.0, share) / 100 * self.gpus(event.job_id)
        self.metrics.gpu_hours_lost.inc(lost / HOUR_S)

    def evicted(self, job_id: str, decision: Decision, outcome: str) -> None:
        """An eviction Slurm carried out (or is carrying out): its cost and expected saving."""
        if outcome not in {"verified", "pending"}:  # pending: Slurm has it, not yet confirmed
            return
        gpus = self.gpus(job_id)
        if decision.cost_s is not None:
            self.metrics.gpu_hours_spent.inc(decision.cost_s * gpus / HOUR_S)
        if decision.saved_s is not None:
            self.metrics.gpu_hours_saved.inc(decision.saved_s * gpus / HOUR_S)

    def service(self, leading: bool, state: ServiceState | None) -> None:
        """This instance's role and, when it leads, the pause and the breaker."""
        self.metrics.leader.set(1 if leading else 0)
        if leading and state is not None:
            self.metrics.paused.set(1 if state.paused() is not None else 0)
            self.metrics.breaker_open.set(1 if state.breaker() is not None else 0)

    def forget_all_but(self, running: Iterable[str]) -> None:
        keep = set(running)
        self._ranks = {j: r for j, r in self._ranks.items() if j in keep}
        self._counted = {k: v for k, v in self._counted.items() if k[0] in keep}
