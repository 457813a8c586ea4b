"""Structure is not a straggler (issue 14): ranks that do different work by design (pipeline
stages, another GPU model on a few nodes) are compared with their own kind, learned at the end
of the warm-up or given as peer-group labels; a lone slow worker is still found, quickly, also
when steps are long."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from slurm_plugin.cli.main import cli
from slurm_plugin.detection import DetectionParams, Detector, StragglerEvent
from slurm_plugin.policy.decide import is_slowdown
from slurm_plugin.policy.loader import load_policy
from tests.scenarios.generator import JobSpec, generate, pipeline, step_change, write_csv

REPO = Path(__file__).resolve().parents[2]
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


def test_a_gpu_slow_from_step_0_in_the_faster_stage_is_still_found() -> None:
    """Two stages on two nodes each (32 GPUs, the later stage +24 % by design, no labels)
    and one GPU of the first stage +9 % from step 0 (the job waits for the later stage, so
    it costs the job nothing): the GPU is compared with its stage and reported; it read as
    4 % *faster* than the job's median rank before, and its node was never seen slow."""
    slow, _ = pipeline(32, [0.0, 0.24])
    slow[10] = step_change(0.09, 0)
    events, det = _events(JobSpec("f", 32, 400, seed=3, compute_slow=slow))
    assert {(tuple(e.ranks), e.node) for e in events} == {((10,), "n0001")}, events
    assert events[0].slowdown_pct == pytest.approx(9, abs=2)
    detector = det._jobs["f"].detector
    assert detector is not None
    assert sorted(int(str(g["ranks"])) for g in detector.structure) == [16, 16]


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


# -- issue 24: structure in every shape -------------------------------------------------------


def _per_step(values: np.ndarray, column: int) -> Callable[[np.ndarray], np.ndarray]:
    """A rank's extra compute per step, read from a (steps x columns) table."""
    return lambda steps: values[steps, column]


def test_the_same_gpu_position_slow_on_every_node_is_structure() -> None:
    """Each node holds a whole pipeline, its last stage on local GPU 7 (+20 % by design, no
    labels): no node and no rank is a straggler; a real +7 % GPU from step 150 still is."""
    slow = {r: step_change(0.2, 0) for r in range(7, WORLD, 8)}
    slow[20] = step_change(0.07, 150)
    events, det = _events(JobSpec("g", WORLD, 500, seed=12, compute_slow=slow))
    assert {(tuple(e.ranks), e.node) for e in events} == {((20,), "n0002")}, events
    detector = det._jobs["g"].detector
    assert detector is not None
    (group,) = detector.structure
    assert group["ranks"] == WORLD // 8


def test_a_nodes_gpus_sharing_one_load_are_one_witness() -> None:
    """Tensor parallelism with sequence-length imbalance: the 8 GPUs of a node share one load
    each step (+-8 %, lognormal, independent across nodes and steps). A node chart adding
    its ranks up as independent would see 8 witnesses of each heavy step; no node is
    flagged in 2,000 steps. A node really 15 % slower from step 1,000 still is."""
    rng = np.random.default_rng(4)
    load = rng.lognormal(0.0, 0.08, size=(2000, WORLD // 8)) - 1.0
    slow = {r: _per_step(load, r // 8) for r in range(WORLD)}
    healthy, _ = _events(JobSpec("tp", WORLD, 2000, seed=4, compute_slow=slow))
    assert healthy == []
    extra = load.copy()
    extra[1000:, 5] = (1.0 + extra[1000:, 5]) * 1.15 - 1.0
    slow = {r: _per_step(extra, r // 8) for r in range(WORLD)}
    found, _ = _events(JobSpec("tp", WORLD, 2000, seed=4, compute_slow=slow))
    assert {e.node for e in found} == {"n0005"}, found
    assert found[0].step >= 1000


def test_imbalance_that_moves_between_ranks_is_never_an_eviction(tmp_path: Path) -> None:
    """Mixture-of-experts routing: each step a random eighth of the ranks gets +30 % of
    tokens. A rank with two heavy steps in a row trips its chart (the scores are far from
    Gaussian), but the job waits for the heaviest rank of each step whichever it is: for
    nearly every report the what-if of the job's steps without the node is no faster, so it
    is no slowdown of the job (not acted on, not noted, no incident). The rest last seconds:
    the backtest under the shipped `evict` policy evicts nothing and marks no node. A real
    +15 % GPU is a slowdown of the job (about 2 % of its time: the steps on which it is heavy
    too wait for it)."""
    rng = np.random.default_rng(8)
    heavy = (rng.random((2000, WORLD)) < 0.125) * 0.3
    slow = {r: _per_step(heavy, r) for r in range(WORLD)}
    spec = JobSpec("moe", WORLD, 2000, seed=8, compute_slow=slow)
    events, _ = _events(spec)
    evict = load_policy(REPO / "policies" / "evict.toml")
    slowdowns = [e for e in events if is_slowdown(e, evict)]
    assert len(slowdowns) < 0.1 * len(events), (len(slowdowns), len(events))
    path = tmp_path / "moe.csv"
    write_csv([("moe", generate(spec))], str(path))
    result = CliRunner().invoke(
        cli, ["backtest", str(path), "--policy", str(REPO / "policies" / "evict.toml"), "--json"]
    )
    assert result.exit_code == 0, result.output
    replayed = json.loads(result.stdout)
    assert [d for d in replayed["detections"] if d["action"] == "evict"] == []
    assert replayed["persistent_nodes"] == []
    heavy[1000:, 44] = (1.0 + heavy[1000:, 44]) * 1.15 - 1.0
    slow = {r: _per_step(heavy, r) for r in range(WORLD)}
    events, _ = _events(JobSpec("moe", WORLD, 2000, seed=8, compute_slow=slow))
    late = [e for e in events if is_slowdown(e, evict) and e.step > 1100]
    mine = [e for e in late if 44 in e.ranks]
    assert mine, late
    assert max(e.job_loss_pct or 0.0 for e in mine) > 1.0


@pytest.mark.parametrize("offset", [0.02, 0.25])
def test_a_labelled_group_is_always_compared_within_itself(offset: float) -> None:
    """Another GPU model on half the nodes, labelled (`group`): +2 % (small against the
    noise) or +25 %. Nothing is flagged; a real +7 % GPU of the other model from step 150
    is, and only it."""
    slow = {r: step_change(offset, 0) for r in range(WORLD // 2, WORLD)}
    labels = {r: "sku_b" if r >= WORLD // 2 else "sku_a" for r in range(WORLD)}
    spec = JobSpec("mix", WORLD, 500, seed=13, compute_slow=slow, groups=labels)
    assert _events(spec)[0] == []
    slow[60] = lambda steps: np.where(steps >= 150, (1 + offset) * 1.07 - 1, offset)
    events, det = _events(JobSpec("mix", WORLD, 500, seed=13, compute_slow=slow, groups=labels))
    assert {(tuple(e.ranks), e.node) for e in events} == {((60,), "n0007")}, events
    detector = det._jobs["mix"].detector
    assert detector is not None
    assert {g["ranks"] for g in detector.structure} <= {WORLD // 2}


def test_a_labelled_group_too_small_to_compare_within_is_inferred() -> None:
    """A labelled first pipeline stage of two ranks, +2 %: too few to compare with each
    other, so it is judged as unlabelled ranks are (a rank alone is never structure). The
    rest of the job, labelled `stage1`, is compared within itself; nothing is flagged."""
    labels = {r: "stage0" if r < 2 else "stage1" for r in range(WORLD)}
    slow = {r: step_change(0.02, 0) for r in range(2)}
    events, _ = _events(JobSpec("fs", WORLD, 500, seed=14, compute_slow=slow, groups=labels))
    assert all(e.slowdown_pct < 3.0 for e in events), events


def test_a_gpu_position_is_structure_also_beside_a_node_slow_from_the_start() -> None:
    """Two nodes, each holding a whole pipeline (local GPU 7 +20 % by design), one of them
    40 % slow on every GPU from the first step (a fault). Against the job's median the two
    GPU 7s share no offset; against their own nodes they do: structure. The slow node is
    the only straggler, and the healthy node's GPU 7 is never reported."""
    slow = {r: step_change(0.2, 0) for r in (7, 15)}
    for r in range(8, 16):
        base = 0.2 if r == 15 else 0.0
        slow[r] = step_change((1 + base) * 1.4 - 1, 0)
    events, det = _events(JobSpec("two", 16, 300, seed=15, compute_slow=slow))
    assert events
    assert {e.node for e in events} == {"n0001"}, events
    detector = det._jobs["two"].detector
    assert detector is not None
    assert [g["ranks"] for g in detector.structure] == [2]


def test_close_stages_are_each_their_own_structure() -> None:
    """Issue 24 (a hold-out cluster month): eight 2-node pipeline stages, unlabelled, whose
    offsets lie close together (+21.7 %, +21.9 %, +22.3 % and +27.7 % among them). One offset for
    every stage that sorted into one cluster left the +27.7 % stage ~4.5 % over it: both its
    nodes were flagged from the first steps and, in time, evicted. Stages are split where
    their nodes' levels differ by more than half the minimum slowdown: nothing is flagged;
    one node of the +27.7 % stage slowed a further 20 % from step 300 still is."""
    offsets = [0.0, 0.029, 0.217, 0.277, 0.063, 0.219, 0.074, 0.223]
    slow, _ = pipeline(128, offsets)
    events, _ = _events(JobSpec("c", 128, 600, seed=15, compute_slow=slow))
    assert events == [], {(e.node, e.step) for e in events}
    for rank in range(56, 64):  # n0007, the second node of the +27.7 % stage
        slow[rank] = lambda steps: np.where(steps >= 300, 1.277 * 1.2 - 1.0, 0.277)
    events, _ = _events(JobSpec("c", 128, 600, seed=15, compute_slow=slow))
    assert {e.node for e in events} == {"n0007"}, {(e.node, e.step) for e in events}


@pytest.mark.parametrize("seed", range(16))
def test_a_job_on_one_node_learns_what_the_whole_arithmetic_learns(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The short cut for unlabelled jobs on fewer nodes than a stage must cover gives what
    the arithmetic gives: nothing, whatever the ranks' offsets (a slow GPU position, a half of
    the node offset); with labels, or on two nodes, it is not taken."""
    from slurm_plugin.detection import structure  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    world = int(rng.integers(2, 17))
    offset = rng.normal(0.0, 0.2, world) * (rng.random(world) < 0.5)
    steps = 30.0
    warm = structure.Warmup(offset * steps, (offset**2 + 0.01**2) * steps, np.full(world, steps))
    nodes = int(rng.integers(1, 3))
    labels = np.full(world, -1) if seed % 4 else np.arange(world) % 2
    layout = structure.Layout(
        np.arange(world) % nodes, np.arange(world) % 8, labels, [f"n{i}" for i in range(nodes)]
    )
    params = DetectionParams()
    offsets, found = structure.learn(warm, layout, params)
    assert structure._nothing_to_learn(layout, params) == (nodes == 1 and seed % 4 != 0)
    monkeypatch.setattr(structure, "_nothing_to_learn", lambda *_: False)
    whole = structure.learn(warm, layout, params)
    assert found == whole[1]
    assert np.array_equal(offsets, whole[0])


def test_a_labelled_stage_held_only_by_a_node_slow_elsewhere_is_not_structure() -> None:
    """Issue 36, class 6 (gauss month seed 1 with two-node pipelines, job 100100): a 16-GPU
    job of two labelled stages, one a node; that node is +30 % from the first step and other
    jobs saw it slow lately. Its stage's offset is its fault: reported (it was taken for the
    stage's design and never reported). The same stage on a node no other job saw slow
    stays the job's structure."""
    slow, labels = pipeline(16, [0.0, 0.3])
    spec = JobSpec("pp2", 16, 400, seed=3, compute_slow=slow, groups=labels)
    quiet, _ = _events(spec)
    assert not [e for e in quiet if e.cause == "compute"]
    det = Detector()
    det.suspect("pp2", ["n0001"])
    det.add("pp2", generate(spec))
    found = [e for e in det.advance(final=True) if isinstance(e, StragglerEvent)]
    assert {e.node for e in found} == {"n0001"}
    # Slow since the first step, and its label gives it no peer elsewhere: from the start;
    # the whole node, so no stage's shape.
    assert all(e.slowdown_pct > 20.0 and e.from_start and not e.maybe_a_stage for e in found)


def test_a_labelled_faster_stage_on_a_node_slow_elsewhere_is_still_structure() -> None:
    """Gauss month seed 3 with two-node pipelines (job 100074): the node other jobs saw slow
    held the *faster* of two labelled stages. Taken for no structure, it made the healthy
    slower stage's node read +14 % against it, and that node was evicted. A faster stage is
    no fault of its nodes: it stays structure, and nothing is reported."""
    slow, labels = pipeline(16, [0.0, 0.3])
    det = Detector()
    det.suspect("pp3", ["n0000"])
    det.add("pp3", generate(JobSpec("pp3", 16, 400, seed=3, compute_slow=slow, groups=labels)))
    found = [e for e in det.advance(final=True) if isinstance(e, StragglerEvent)]
    assert not [e for e in found if e.cause == "compute" and e.slowdown_pct > 5.0], found
