"""Structure: ranks that do different work by design, learned at the end of a job's warm-up.

A labelled peer group's common offset, ranks that share a compute offset across several
nodes, and a local GPU position that is offset on most nodes (each node holds a whole
pipeline) are structure, not stragglers: from then on each is compared with its own baseline.
A lone rank or a single node that is slow from the start stays a straggler, and so do nodes
slow from the start that other jobs saw slow too (``Layout.suspect``): an offset that only
such nodes share is their fault, not this job's structure, also when a label names them a
stage of their own (a two-node pipeline's stage fills one node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from slurm_plugin.detection.params import F64, DetectionParams


@dataclass(frozen=True)
class Layout:
    """Where a job's ranks run: per rank its node (an index into ``node_names``), its local
    GPU (empty when unknown) and its peer-group label (-1: none)."""

    rank_node: np.ndarray
    rank_gpu: np.ndarray
    rank_group: np.ndarray
    node_names: list[str]
    #: Indices (into ``node_names``) of the nodes other jobs saw slow lately (node history):
    #: an offset shared only by them is not structure.
    suspect: frozenset[int] = frozenset()

    @property
    def world(self) -> int:
        """Ranks in the job."""
        return len(self.rank_node)


@dataclass(frozen=True)
class Warmup:
    """Per rank, the sums over the warm-up of log(compute / the step's median compute), of
    its square, and how many steps each rank measured."""

    log: F64
    log2: F64
    n: F64


def learn(warm: Warmup, layout: Layout, p: DetectionParams) -> tuple[F64, list[dict[str, object]]]:
    """Per rank, the log of its by-design compute offset (0: none), and what was taken for
    structure (offset %, ranks, nodes), for logs and tests."""
    if _nothing_to_learn(layout, p):
        return np.zeros(layout.world), []
    n = np.maximum(warm.n, 1)
    base = np.where(warm.n > 0, warm.log / n, np.nan)
    # Noise is each rank's own step-to-step spread (the cross-rank spread would count the
    # structure as noise). An offset shared by ranks on several nodes is a mean over all
    # their warm-up steps: it must stand above four times that mean's error.
    own = np.sqrt(np.maximum(warm.log2 / n - base**2, 0.0))
    if layout.suspect:  # offsets against the nodes not slow elsewhere: with two of four
        # nodes suspect, the step's median lies between the halves and the healthy half
        # would look like a stage of its own (-17 % against +17 %)
        trusted = ~np.isin(layout.rank_node, sorted(layout.suspect)) & np.isfinite(base)
        if trusted.any():
            base = base - float(np.median(base[trusted]))
    jitter = float(np.nanmedian(own)) if np.isfinite(own).any() else 0.0
    floor = p.spread_floor_pct / 100.0
    shared = max(floor, 4.0 * max(jitter, floor) / math.sqrt(float(np.nanmax(n))))
    groups: list[np.ndarray] = []
    world = layout.world
    labels = layout.rank_group if len(layout.rank_group) == world else np.full(world, -1)
    inferred = labels < 0
    for label in np.unique(labels[labels >= 0]).tolist():
        members = np.flatnonzero((labels == label) & np.isfinite(base))
        if _only_on(members, layout.suspect, layout) and float(np.median(base[members])) > 0:
            continue  # a slower stage held only by nodes slow elsewhere: its offset is theirs
        if len(members) >= 3:
            groups.append(members)  # labelled: always compared within the group
        else:  # too small a group to compare within: its structure is inferred
            inferred[labels == label] = True
    # Each rank against its own node first: a GPU position slow on every node is structure
    # also when a whole node is slow besides (a fault from the job's first step).
    relative = _node_relative(base, layout)
    positions = _gpu_positions(relative, shared, layout, p, inferred)
    taken = np.zeros(world, dtype=bool)
    for members in positions:
        taken[members] = True
    unlabelled = np.flatnonzero(inferred & ~taken & np.isfinite(base) & (np.abs(base) > shared))
    stages = _shared_offsets(unlabelled, base, shared, layout, p)
    groups += _whole_nodes(stages, inferred & ~taken & np.isfinite(base), layout)
    learned = [(m, base[m]) for m in groups] + [(m, relative[m]) for m in positions]
    offsets = np.zeros(world)
    found: list[dict[str, object]] = []
    for members, own in learned:
        offset = float(np.median(own))
        labelled = not bool(inferred[members[0]])
        if abs(offset) <= (floor if labelled else shared):
            continue
        offsets[members] = offset
        found.append(
            {
                "offset_pct": round(math.expm1(offset) * 100.0, 1),
                "ranks": len(members),
                "nodes": sorted({layout.node_names[i] for i in layout.rank_node[members]}),
                "rank_ids": [int(r) for r in members[:32]],
            }
        )
    return offsets, found


def _only_on(members: np.ndarray, nodes: frozenset[int], layout: Layout) -> bool:
    """``members`` all run on ``nodes`` (a labelled stage on one or two suspect nodes of a
    small job: a fault of theirs from the first step sits in its offset, never reported;
    a faster stage there is still the job's design, measured against the other nodes)."""
    return bool(nodes) and len(members) > 0 and set(layout.rank_node[members].tolist()) <= nodes


def _nothing_to_learn(layout: Layout, p: DetectionParams) -> bool:
    """No rank is labelled and the ranks are on fewer than ``structure_min_nodes`` nodes (a
    job of one node, most jobs of a cluster): an inferred stage or GPU position must cover
    that many nodes, so none can be found (and the arithmetic is skipped: ~0.2 ms a job, for
    thousands of jobs whose warm-up ends together after the service restarts)."""
    if len(layout.rank_group) == layout.world and bool((layout.rank_group >= 0).any()):
        return False
    return len(np.unique(layout.rank_node)) < p.structure_min_nodes


def _shared_offsets(
    candidates: np.ndarray, base: F64, shared: float, layout: Layout, p: DetectionParams
) -> list[np.ndarray]:
    """Clusters of ``candidates`` with one offset (sorted by offset, split at gaps) that
    cover whole nodes (most of a node's ranks) on at least ``structure_min_nodes`` nodes."""
    order = candidates[np.argsort(base[candidates], kind="stable")]
    if not len(order):
        return []
    values = base[order]
    gaps = np.diff(values) > np.maximum(2.0 * shared, 0.25 * np.abs(values[1:]))
    rank_node = layout.rank_node
    per_node = np.bincount(rank_node, minlength=len(layout.node_names))
    found: list[np.ndarray] = []
    for cluster in np.split(order, np.flatnonzero(gaps) + 1):
        if len(cluster) < 2:
            continue
        # A by-design offset covers nodes (a pipeline stage, another GPU model): a node
        # counts when most of its ranks share it, never for one rank that happens to.
        inside = np.bincount(rank_node[cluster], minlength=len(per_node))
        nodes = np.flatnonzero(2 * inside > per_node)
        # Nodes slow in other jobs too that share an offset only among themselves (two bad
        # nodes of one pool, both slow from the job's first step) are stragglers: one node
        # of the job's own beside them keeps it a stage (a stage on a node once slow).
        if all(int(n) in layout.suspect for n in nodes):
            continue
        if len(nodes) >= p.structure_min_nodes:
            members = cluster[np.isin(rank_node[cluster], nodes)]
            found += _by_node_level(members, base, rank_node, p)
    return found


def _whole_nodes(stages: list[np.ndarray], free: np.ndarray, layout: Layout) -> list[np.ndarray]:
    """Each inferred stage with the other ranks of its nodes (``free``: in no group yet): a
    stage covers whole nodes, so a GPU of one of them off its stage's offset (slow from the
    job's first step) is compared with its stage and stays a straggler there. Left out, it
    was compared with the job's median rank: one GPU +9 % in the faster of two stages read
    4 % *fast*, and the node never showed."""
    if not stages:
        return stages
    free = free.copy()
    for members in stages:
        free[members] = False
    out = []
    for members in stages:
        extra = np.flatnonzero(free & np.isin(layout.rank_node, layout.rank_node[members]))
        free[extra] = False
        out.append(np.union1d(members, extra) if len(extra) else members)
    return out


def _by_node_level(
    members: np.ndarray, base: F64, rank_node: np.ndarray, p: DetectionParams
) -> list[np.ndarray]:
    """One cluster's ranks split where their nodes' levels differ by more than half the
    policy's minimum slowdown (what the detector acts on): stages of +6 % and +12 % are two
    groups, each of at least ``structure_min_nodes`` nodes (one offset for both left either
    stage 3 % off its own level, a straggler on every node of it). A level held by fewer
    nodes joins its nearest neighbour: one node off the others is no stage of its own (a
    fault from the job's first step stays a straggler against its stage)."""
    nodes = np.unique(rank_node[members])
    levels = np.array([float(np.median(base[members[rank_node[members] == n]])) for n in nodes])
    order = np.argsort(levels, kind="stable")
    cut = np.flatnonzero(np.diff(levels[order]) > 0.5 * p.min_slowdown_pct / 100.0) + 1
    parts = [list(part) for part in np.split(order, cut)]
    # Too small a part joins its nearest neighbour, until every part is large enough.
    while len(parts) > 1 and min(len(part) for part in parts) < p.structure_min_nodes:
        i = min(range(len(parts)), key=lambda j: len(parts[j]))
        mid = float(np.median(levels[parts[i]]))
        neighbours = [j for j in (i - 1, i + 1) if 0 <= j < len(parts)]
        j = min(neighbours, key=lambda k: abs(float(np.median(levels[parts[k]])) - mid))
        parts[j] = sorted(parts[j] + parts[i], key=lambda k: levels[k])
        del parts[i]
    return [members[np.isin(rank_node[members], nodes[part])] for part in parts]


def _node_relative(base: F64, layout: Layout) -> F64:
    """Each rank's offset against the median rank of its own node."""
    out = np.full(len(base), np.nan)
    for node in np.unique(layout.rank_node).tolist():
        on = np.flatnonzero(layout.rank_node == node)
        known = on[np.isfinite(base[on])]
        if len(known) >= 2:
            out[known] = base[known] - float(np.median(base[known]))
    return out


def _gpu_positions(
    relative: F64, shared: float, layout: Layout, p: DetectionParams, inferred: np.ndarray
) -> list[np.ndarray]:
    """Local GPU positions offset the same way against their own node on most of the job's
    nodes (and at least ``structure_min_nodes``): the stage each node holds there (a whole
    pipeline per node, its last stage on GPU 7). The group is the position on every node
    (some ranks' estimates fall under the threshold by chance; their node holds the same
    stage there)."""
    if len(layout.rank_gpu) != layout.world:
        return []
    per_node = np.bincount(layout.rank_node, minlength=len(layout.node_names))
    job_nodes = int(np.count_nonzero(per_node))
    needed = max(p.structure_min_nodes, (job_nodes + 1) // 2)
    found: list[np.ndarray] = []
    for gpu in np.unique(layout.rank_gpu).tolist():
        at = np.flatnonzero((layout.rank_gpu == gpu) & inferred & np.isfinite(relative))
        if not len(at):
            continue
        typical = float(np.median(relative[at]))
        if abs(typical) <= shared:
            continue
        # Most nodes agree on the position's offset (a bad GPU there on one node does not
        # spoil it: it stays a straggler against the learned baseline).
        agree = at[np.abs(relative[at] - typical) <= max(2.0 * shared, 0.5 * abs(typical))]
        if len(np.unique(layout.rank_node[agree])) >= needed:
            found.append(at)
    return found


def warm_excess(warm: Warmup, offset: F64, ranks: np.ndarray, others: np.ndarray) -> F64:
    """Per rank of ``ranks``, how much slower (log) it computed than ``others`` (their
    median) through the warm-up, with what was taken for structure divided out (NaN: it, or
    all of them, measured nothing)."""
    mean = np.where(warm.n > 0, warm.log / np.maximum(warm.n, 1), np.nan) - offset
    theirs = mean[others]
    if not np.isfinite(theirs).any():
        return np.full(len(ranks), np.nan)
    excess: F64 = mean[ranks] - float(np.nanmedian(theirs))
    return excess


def from_start(
    warm: Warmup,
    offset: F64,
    group: np.ndarray,
    ranks: list[int],
    on_node: np.ndarray,
    others: np.ndarray,
    slowdown_pct: float,
    *,
    few_nodes: bool,
) -> tuple[bool, bool]:
    """:attr:`StragglerEvent.from_start` of a report on ``ranks`` of the node holding
    ``on_node`` (they computed slower than the ``others`` through the warm-up by at least
    half the ``slowdown_pct`` reported now) and :attr:`StragglerEvent.maybe_a_stage` (more
    than one of the node's GPUs did so, not all, in a job of too few nodes to learn its
    stages). Labels (``group``, per rank, -1: none) rule both out only where they give the
    ranks peers on another node: a stage this node holds alone has none."""
    if len(group) == len(warm.n):
        mine = group[ranks][group[ranks] >= 0]
        if np.isin(mine, np.delete(group, on_node)).any():  # a labelled peer elsewhere
            return False, False
    if not len(others) or not slowdown_pct > 0:
        return False, False
    excess = warm_excess(warm, offset, on_node, others)
    bar = 0.5 * math.log1p(slowdown_pct / 100.0)
    mine_excess = excess[np.isin(on_node, ranks)]
    start = bool(np.isfinite(mine_excess).any() and np.nanmean(mine_excess) >= bar)
    slow = int(np.sum(excess >= bar))
    return start, start and few_nodes and 1 < slow < len(on_node)
