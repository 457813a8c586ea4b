"""Which detector holds each job (service/detectors.py), through the service's cycles: a job
whose policy changes moves to that policy's detector, and a job that ends is forgotten."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from slurm_plugin.detection import DetectionParams, Detector
from slurm_plugin.testing import FakeClock, FakeScheduler
from tests.integration.loop_harness import NODES, Loop, make_loop, run_cycles, running_job

__all__ = ["make_loop"]  # the fixture, shared with the control loop's tests


class _Watched(Detector):
    """A detector that keeps which jobs it was told to forget."""

    def __init__(self, params: DetectionParams) -> None:
        super().__init__(params)
        self.forgotten: list[str] = []

    def forget(self, job_id: str) -> None:
        self.forgotten.append(job_id)
        super().forget(job_id)


def test_a_job_whose_policy_changes_moves_to_its_detector_and_one_that_ends_is_forgotten(
    make_loop: Callable[..., Loop],
) -> None:
    """Job 5 runs under `evict`, then its comment names `evict-aggressive` (an admin's edit):
    the next cycle takes its steps into that policy's detector, the first forgets it, and the
    job's service record shows the policy it runs under. Job 6 under `evict` shares job 5's
    first detector. When job 5 stops running, its detector forgets it and no detector holds
    it any more."""
    clock = FakeClock()
    slurm = FakeScheduler([running_job(clock), running_job(clock, job_id="6")], NODES)
    made: list[_Watched] = []

    def watched(params: DetectionParams) -> Detector:
        made.append(_Watched(params))
        return made[-1]

    loop = make_loop(slurm, clock, "a", detector=watched)
    detectors = loop.service._detectors
    run_cycles(loop, 0, 1, {}, jobs=("5", "6"))
    first = detectors.of("5")
    assert first is not None
    assert detectors.of("6") is first
    assert loop.state.job("5")["policy"] == "evict"
    slurm.job_table["5"] = replace(
        slurm.job_table["5"], comment="straggler:policy=evict-aggressive"
    )
    run_cycles(loop, 10, 1, {}, jobs=("5", "6"))
    second = detectors.of("5")
    assert second is not None
    assert second is not first
    assert made == [first, second]
    old, new = made
    assert (old.forgotten, new.forgotten) == (["5"], [])
    assert detectors.of("6") is first
    assert loop.state.job("5")["policy"] == "evict-aggressive"
    del slurm.job_table["5"]
    run_cycles(loop, 20, 1, {}, jobs=("6",))
    assert detectors.of("5") is None
    assert sorted(detectors.jobs()) == ["6"]
    assert new.forgotten == ["5"]
