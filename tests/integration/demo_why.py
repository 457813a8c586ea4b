"""Why the demo's node3 was found, read from the run's own telemetry: what the demo and the
training stacks' tests both hold."""

from __future__ import annotations

import statistics

from slurm_plugin.demo.run import DemoRun

#: The step in progress when node3 was slowed began before it: "after" starts at the next one
#: (by step, not by time: the policy may evict seconds after the onset, right after a
#: checkpoint, and a slowed step takes seconds).
_SETTLE_STEPS = 2


def _median(run: DemoRun, node: str, attr: str, *, after_onset: bool) -> float:
    onset, onset_step = run.onset_ts or 0.0, run.onset_step or 0
    values = [
        getattr(r, attr)
        for r in run.records
        if r.attempt == 0
        and r.node == node
        and getattr(r, attr) is not None
        and (
            r.step >= onset_step + _SETTLE_STEPS
            if after_onset
            else (r.ts < onset and 5 <= r.step <= onset_step)
        )
    ]
    steps = sorted({r.step for r in run.records if r.attempt == 0 and r.node == node})
    assert values, (
        f"no {attr} of {node} {'after' if after_onset else 'before'} the onset "
        f"(step {onset_step}); its steps of the first run: {steps[:3]}..{steps[-3:]}"
    )
    return float(statistics.median(values))


#: How much longer node3's ranks compute once slowed, at least, than before and than the others.
_FAR_LONGER = 1.5


def check_why(run: DemoRun) -> None:
    """Why node3 was found: its ranks compute far longer than before and than the others, who
    wait longer for them than before (by at least a third of node3's extra compute). Whether
    node3 itself waits less than the others is not held: a CPU quota also slows its share of
    the collectives' work (CI once saw its wait above theirs, 0.46 s against 0.43 s). For the
    same reason how much of the quota lands in node3's compute varies (FSDP2's compute is split
    by a collective per layer): usually several times, once on CI 1.9x (0.078 s against 0.041 s
    before and 0.044 s on the others), so it is held at 1.5x its own and the others'."""
    nodes = ("node1", "node2", "node3")
    compute = {
        (n, a): _median(run, n, "compute_s", after_onset=a) for n in nodes for a in (False, True)
    }
    wait = {(n, a): _median(run, n, "comm_s", after_onset=a) for n in nodes for a in (False, True)}
    figures = f"compute {compute}\nwait {wait}"
    assert compute["node3", True] > _FAR_LONGER * compute["node3", False], figures
    for node in ("node1", "node2"):
        # The others wait for node3's extra compute: at least a third of it shows as more wait.
        extra = compute["node3", True] - compute[node, True]
        assert wait[node, True] > wait[node, False] + max(0.05, extra / 3), figures
        assert compute["node3", True] > _FAR_LONGER * compute[node, True], figures
