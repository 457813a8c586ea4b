"""Structure is not a straggler (issue 14): ranks that do different work by design (pipeline
stages, another GPU model on a few nodes) are compared with their own kind, learned at the end
of the warm-up or given as peer-group labels; a lone slow worker is still found, quickly, also
when steps are long."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from slurm_plugin.cli.main import cli
from slurm_plugin.detection import DetectionParams, Detector, StragglerEvent
from tests.scenarios.generator import JobSpec, generate, pipeline, step_change, write_csv

WORLD = 96  # 12 nodes of 8 GPUs; three stages of four nodes each


def _events(
    spec: JobSpec, params: DetectionParams | None = None
) -> tuple[list[StragglerEvent], Detector]:
    det = Detector(params)
    det.add(spec.job_id, generate(spec))
    events = [e for e in det.advance(final=True) if isinstance(e, StragglerEvent)]
    return events, det


def _pipeline_job(labelled: bool, straggler: bool) -> JobSpec:
    slow, labels = pipeline(WORLD, [0.0, 0.08, 0.25])
    if straggler:  # a real +7 % GPU in the first stage from step 150
        slow[20] = step_change(0.07, 150)
    return JobSpec("p", WORLD, 500, seed=11, compute_slow=slow, groups=labels if labelled else {})


@pytest.mark.parametrize("labelled", [False, True], ids=["inferred", "labelled"])
def test_pipeline_stages_are_structure_and_the_real_straggler_is_found(labelled: bool) -> None:
    """Stages at +8 % and +25 % from step 0 flag nothing; one GPU at +7 % from step 150 is
    the only event, with or without group labels."""
    events, det = _events(_pipeline_job(labelled, straggler=True))
    assert {(tuple(e.ranks), e.node) for e in events} == {((20,), "n0002")}, events
    assert 150 <= events[0].step <= 200
    detector = det._jobs["p"].detector
    assert detector is not None
    # Offsets against the median rank, which is in the +8 % stage: 1/1.08 and 1.25/1.08.
    offsets = sorted(float(str(g["offset_pct"])) for g in detector.structure)
    assert offsets == [pytest.approx(-7.4, abs=1), pytest.approx(15.7, abs=1)], offsets


@pytest.mark.parametrize("labelled", [False, True], ids=["inferred", "labelled"])
def test_pipeline_without_a_straggler_raises_nothing(labelled: bool) -> None:
    """The same pipeline, healthy: no event in 500 steps."""
    events, _ = _events(_pipeline_job(labelled, straggler=False))
    assert events == []


def test_without_structure_learning_the_stages_would_be_evicted() -> None:
    """Why this exists: with inference off (no group spans enough nodes) every node of the
    +25 % stage is flagged."""
    events, _ = _events(
        _pipeline_job(labelled=False, straggler=False),
        DetectionParams(structure_min_nodes=1000),
    )
    assert {e.node for e in events} >= {"n0008", "n0009", "n0010", "n0011"}


def test_another_gpu_model_on_two_nodes_is_structure() -> None:
    """Two nodes of a slower SKU (+15 % from the first step) in a 64-GPU job: no event."""
    slow = {r: step_change(0.15, 0) for r in range(16, 32)}
    events, _ = _events(JobSpec("s", 64, 400, seed=5, compute_slow=slow))
    assert events == []


def test_a_single_node_slow_from_the_start_is_still_a_straggler() -> None:
    """One node 2x slow from step 0 does not make a structure group (one node): flagged."""
    slow = {r: step_change(1.0, 0) for r in range(8, 16)}
    events, _ = _events(JobSpec("n", 64, 100, seed=6, compute_slow=slow))
    assert {(e.node, e.scope) for e in events} == {("n0001", "node")}
    assert events[0].step <= DetectionParams().warmup_steps + 1  # right after the warm-up


def test_a_worker_slow_from_step_0_of_long_steps_is_found_within_5_steps() -> None:
    """A worker 1.8x slow from the first step of a 50-step job of ~30 s steps: the warm-up
    ends after a minute (3 steps), and the worker is reported within 5 steps."""
    spec = JobSpec(
        "w",
        32,
        50,
        seed=7,
        compute_s=30.0,
        data_s=0.5,
        transfer_s=1.0,
        checkpoint_every=0,
        compute_slow={5: step_change(0.8, 0)},
    )
    events, _ = _events(spec)
    assert {tuple(e.ranks) for e in events} == {(5,)}, events
    assert events[0].step < 5
    assert events[0].slowdown_pct == pytest.approx(80, abs=5)


@pytest.mark.parametrize("labelled", [False, True], ids=["inferred", "labelled"])
def test_the_backtest_sees_structure_as_the_service_does(tmp_path: Path, labelled: bool) -> None:
    """The pipeline as a trace CSV (with the optional ``group`` column when labelled): the
    backtest reports the real straggler only."""
    path = tmp_path / "pipeline.csv"
    write_csv([("p", generate(_pipeline_job(labelled, straggler=True)))], str(path))
    assert ("group" in path.read_text().partition("\n")[0]) == labelled
    result = CliRunner().invoke(cli, ["backtest", str(path), "--json"])
    assert result.exit_code == 0, result.output
    detections = json.loads(result.stdout)["detections"]
    assert {(d["node"], d["rank"]) for d in detections} == {("n0002", 20)}, detections


def test_a_warm_up_that_saw_part_of_the_job_is_learned_again() -> None:
    """Ranks that start late (seconds apart under load) leave the first warm-up with part of
    the job: half of it slow node n0002, so the healthy ranks of n0000 and n0003 sit 9 % under
    that median on two nodes, which looks like structure. When the other ranks appear the
    warm-up starts again over all of them: nothing is structure, only n0002 is flagged."""
    spec = JobSpec(
        "late", 32, 300, seed=3, compute_slow={r: step_change(0.2, 0) for r in range(16, 24)}
    )
    batch = generate(spec)
    early = np.isin(batch.rank, [0, 1, 2, 3, *range(16, 24), 24, 25, 26, 27])
    det = Detector()
    det.add("late", batch.take((batch.step < 30) & early))
    first = det.advance()
    det.add("late", batch.take(batch.step >= 30))
    events = [e for e in first + det.advance(final=True) if isinstance(e, StragglerEvent)]
    assert {e.node for e in events} == {"n0002"}, events
    detector = det._jobs["late"].detector
    assert detector is not None
    assert detector.world == 32
    assert detector.structure == []


def test_one_rank_of_another_node_matching_a_slow_node_is_not_structure() -> None:
    """A 3-node job, 2 ranks per node (as on the dev cluster): node n1 +20 % from step 0 and,
    by coincidence, one of n0's two ranks too. Two ranks on two nodes share the offset, but
    n0 is mostly healthy: not structure, so n1 is still reported (CI on Slurm 26.05 saw
    {nodes: [node1, node3], ranks: 2} taken for structure and the slow node never evicted)."""
    nodes = ["n0", "n0", "n1", "n1", "n2", "n2"]
    slow = {1: step_change(0.2, 0), 2: step_change(0.2, 0), 3: step_change(0.2, 0)}
    batch = generate(JobSpec("c", 6, 200, seed=2, compute_slow=slow))
    batch.node = np.asarray([nodes[r] for r in batch.rank], dtype=object)
    det = Detector()
    det.add("c", batch)
    events = [e for e in det.advance(final=True) if isinstance(e, StragglerEvent)]
    detector = det._jobs["c"].detector
    assert detector is not None
    assert detector.structure == []
    assert "n1" in {e.node for e in events}
