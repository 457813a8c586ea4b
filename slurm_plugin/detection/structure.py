"""Structure: ranks that do different work by design, learned at the end of a job's warm-up.

A labelled peer group's common offset, ranks that share a compute offset across several
nodes, and a local GPU position that is offset on most nodes (each node holds a whole
pipeline) are structure, not stragglers: from then on each is compared with its own baseline.
A lone rank or a single node that is slow from the start stays a straggler.
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
    n = np.maximum(warm.n, 1)
    base = np.where(warm.n > 0, warm.log / n, np.nan)
    # Noise is each rank's own step-to-step spread (the cross-rank spread would count the
    # structure as noise). An offset shared by ranks on several nodes is a mean over all
    # their warm-up steps: it must stand above four times that mean's error.
    own = np.sqrt(np.maximum(warm.log2 / n - base**2, 0.0))
    jitter = float(np.nanmedian(own)) if np.isfinite(own).any() else 0.0
    floor = p.spread_floor_pct / 100.0
    shared = max(floor, 4.0 * max(jitter, floor) / math.sqrt(float(np.nanmax(n))))
    groups: list[np.ndarray] = []
    world = layout.world
    labels = layout.rank_group if len(layout.rank_group) == world else np.full(world, -1)
    inferred = labels < 0
    for label in np.unique(labels[labels >= 0]).tolist():
        members = np.flatnonzero((labels == label) & np.isfinite(base))
        if len(members) >= 3:
            groups.append(members)  # labelled: always compared within the group
        else:  # too small a group to compare within: its structure is inferred
            inferred[labels == label] = True
    unlabelled = np.flatnonzero(inferred & np.isfinite(base) & (np.abs(base) > shared))
    groups += _shared_offsets(unlabelled, base, shared, layout, p)
    offsets = np.zeros(world)
    found: list[dict[str, object]] = []
    for members in groups:
        offset = float(np.median(base[members]))
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


def _shared_offsets(
    candidates: np.ndarray, base: F64, shared: float, layout: Layout, p: DetectionParams
) -> list[np.ndarray]:
    """Clusters of ``candidates`` with one offset (sorted by offset, split at gaps) that
    cover whole nodes (most of a node's ranks) on at least ``structure_min_nodes`` nodes,
    or one local GPU position on most of the job's nodes (and at least as many)."""
    order = candidates[np.argsort(base[candidates], kind="stable")]
    if not len(order):
        return []
    values = base[order]
    gaps = np.diff(values) > np.maximum(2.0 * shared, 0.25 * np.abs(values[1:]))
    rank_node, rank_gpu = layout.rank_node, layout.rank_gpu
    per_node = np.bincount(rank_node, minlength=len(layout.node_names))
    job_nodes = int(np.count_nonzero(per_node))
    found: list[np.ndarray] = []
    for cluster in np.split(order, np.flatnonzero(gaps) + 1):
        if len(cluster) < 2:
            continue
        # A by-design offset covers nodes (a pipeline stage, another GPU model): a node
        # counts when most of its ranks share it, never for one rank that happens to.
        inside = np.bincount(rank_node[cluster], minlength=len(per_node))
        nodes = np.flatnonzero(2 * inside > per_node)
        rest = cluster
        if len(nodes) >= p.structure_min_nodes:
            whole = np.isin(rank_node[cluster], nodes)
            found.append(cluster[whole])
            rest = cluster[~whole]
        if len(rank_gpu) != layout.world:
            continue
        # A local GPU position offset on most nodes: the stage each node holds there.
        gpus = rank_gpu[rest]
        for gpu in np.unique(gpus).tolist():
            at = rest[gpus == gpu]
            spread = len(np.unique(rank_node[at]))
            if spread >= max(p.structure_min_nodes, (job_nodes + 1) // 2):
                # The position on every node (some ranks' estimates fell under the
                # threshold by chance; their node holds the same stage there).
                found.append(np.flatnonzero((rank_gpu == gpu) & np.isfinite(base)))
    return found
