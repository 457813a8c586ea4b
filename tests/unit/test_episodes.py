"""Episodes: how long a node's slowdown has lasted, from the reports of it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from slurm_plugin.detection.episodes import Episodes
from slurm_plugin.detection.events import StragglerEvent
from slurm_plugin.detection.params import DetectionParams

NODES = ["n1", "n2"]  # 8 ranks each


def _episodes() -> Episodes:
    return Episodes(DetectionParams(), NODES, np.arange(16), np.array([0, 8]), np.array([0, 1]))


def _report(
    ts: float, *, level: float = 9.0, loss: float = 10.0, gpu: int | None = 3, node: str = "n1"
) -> StragglerEvent:
    """GPU ``gpu`` of ``node`` (None: the whole node) reported at ``ts``, its level ``level``
    spreads above the other ranks' (the bar is 5)."""
    base = 8 * NODES.index(node)
    return StragglerEvent(
        job_id="7",
        node=node,
        gpu=gpu,
        ranks=[base + gpu] if gpu is not None else list(range(base, base + 8)),
        step=int(ts),
        ts=ts,
        cusum_ratio=1.0,
        slowdown_pct=30.0,
        cause="compute",
        scope="gpu" if gpu is not None else "node",
        job_loss_pct=loss,
        level_z=level,
        level_z_min=5.0,
    )


def test_a_report_goes_on_from_the_last_one_of_its_slowdown() -> None:
    episodes = _episodes()
    assert episodes.same_episode(_report(100.0), "compute").since_ts is None
    again = episodes.same_episode(_report(140.0), "compute")
    assert again.since_ts == 100.0
    assert again.lasted_s == 40.0


def test_reports_that_only_blend_in_reach_back_two_rearm_periods_at_most() -> None:
    """Heavy seed 0 of the month benchmark (job 100104, n0818): a healthy rank's drift was
    reported for ~700 s, every report under the stand-out bar, before a real 514 s episode on
    the node; the episode was dated from the first of them ("lasted 839 s", 60 % that it
    lasts) and evicted. While none of an episode's reports stands out it reaches back two
    re-arm periods at most (60 s); once one has, it goes on as any episode does."""
    episodes = _episodes()
    for ts in range(100, 400, 30):  # noise, on and off, for five minutes
        episodes.same_episode(_report(float(ts), level=2.0), "compute")
    real = episodes.same_episode(_report(400.0), "compute")
    assert real.since_ts == 370.0 - 60.0  # the last noise report's reach, not 100 s
    again = episodes.same_episode(_report(430.0, level=4.0), "compute")
    assert again.since_ts == 310.0  # one that blends in goes on from one that stood out
    assert episodes.same_episode(_report(460.0), "compute").since_ts == 310.0


def test_a_report_just_before_a_slowdown_stands_out_dates_it() -> None:
    """The demo's run: the first report, 1.5 s after the onset, blends in (its level still
    builds up); the slowdown is dated from it, not from the next report 30 s later."""
    episodes = _episodes()
    episodes.same_episode(_report(100.0, level=4.0), "compute")
    assert episodes.same_episode(_report(130.0), "compute").since_ts == 100.0


def test_a_report_that_costs_nothing_ends_the_slowdown() -> None:
    episodes = _episodes()
    episodes.same_episode(_report(100.0), "compute")
    episodes.same_episode(_report(130.0, loss=0.1), "compute")
    assert episodes.same_episode(_report(160.0), "compute").since_ts is None


def test_one_gpus_fault_is_not_dated_from_another_gpus_burst() -> None:
    """Heavy seed 5 of the month benchmark (job 100000, n2045): a burst on GPU 5 and then GPU
    0's real 365 s episode read as one episode from the burst on. GPU 0's begins at its own
    report; GPU 5's goes on from its own."""
    episodes = _episodes()
    assert episodes.same_episode(_report(100.0, gpu=5), "compute").since_ts is None
    zero = episodes.same_episode(_report(140.0, gpu=0), "compute")
    assert zero.since_ts is None
    assert episodes.same_episode(_report(170.0, gpu=0), "compute").since_ts == 140.0
    assert episodes.same_episode(_report(180.0, gpu=5), "compute").since_ts == 100.0


def test_a_node_wide_slowdown_goes_on_from_any_of_its_gpus_and_they_from_it() -> None:
    episodes = _episodes()
    episodes.same_episode(_report(100.0, gpu=5), "compute")
    episodes.same_episode(_report(130.0, gpu=0), "compute")
    assert episodes.same_episode(_report(150.0, gpu=None), "compute").since_ts == 100.0
    assert episodes.same_episode(_report(170.0, gpu=2), "compute").since_ts == 100.0
    other = episodes.same_episode(_report(175.0, gpu=2, node="n2"), "compute")
    assert other.since_ts is None  # another node's episodes are its own


def test_a_report_that_costs_nothing_ends_every_episode_of_its_node() -> None:
    episodes = _episodes()
    episodes.same_episode(_report(100.0, gpu=5), "compute")
    episodes.same_episode(_report(110.0, gpu=1, node="n2"), "compute")
    episodes.same_episode(_report(120.0, gpu=None), "compute")
    episodes.same_episode(_report(130.0, gpu=0, loss=0.1), "compute")
    assert episodes.same_episode(_report(140.0, gpu=5), "compute").since_ts is None
    assert episodes.same_episode(_report(160.0, gpu=1, node="n2"), "compute").since_ts == 110.0


def test_reports_that_cost_nothing_have_episodes_of_their_own() -> None:
    """Gauss seed 5 of the month benchmark (job 100054, n1288): one GPU +9 % from the first
    step in the faster of two pipeline stages, reported every re-arm period for the whole
    job at 0 % of the job's time. Each report started afresh ("lasted 51 s"), so node
    history never saw a slowdown that lasted: those reports now go on from each other (the
    node was slow that long), while a report the job pays for never dates from them."""
    episodes = _episodes()
    for ts in range(100, 1000, 30):
        free = episodes.same_episode(_report(float(ts), loss=0.0), "compute")
    assert free.since_ts == 100.0
    assert free.lasted_s == 870.0
    paid = episodes.same_episode(_report(1000.0), "compute")
    assert paid.since_ts is None  # the job's slowdown begins now
    later = episodes.same_episode(_report(1030.0, loss=0.0), "compute")
    assert later.since_ts == 100.0  # the node's own slowness goes on


def test_gpus_that_may_be_a_stage_keep_episodes_of_their_own() -> None:
    """Issue 36, class 6 (gauss seed 9 with two-node pipelines, job 100106): GPUs 4-7 of a
    node, slow since the job's first steps, may be a pipeline stage (noted, never evicted);
    a real fail-slow episode on the whole node 15 minutes later went on from their episode,
    kept their "maybe a stage" and was not evicted. Reports of a possible stage end the
    node's episodes and keep their own: the later slowdown is as old as it is."""
    episodes = _episodes()
    stage = replace(_report(100.0, gpu=None), ranks=[4, 5, 6, 7], maybe_a_stage=True)
    episodes.same_episode(stage, "compute")
    again = episodes.same_episode(replace(stage, ts=130.0, step=130), "compute")
    assert again.since_ts == 100.0  # the stage goes on as itself
    fault = episodes.same_episode(_report(160.0, gpu=None), "compute")
    assert fault.since_ts is None
    assert not fault.maybe_a_stage
    assert episodes.same_episode(_report(190.0, gpu=None), "compute").since_ts == 160.0
