"""Episodes: how long a node's slowdown has lasted, and when it is over.

A node reported again soon after its last report, with no step in between on which that
slowdown was seen to have ended, is the same slowdown going on: it began when that one began
(how long a slowdown has lasted is what tells a passing burst from a lasting fault). A
slowdown that ended is over: the next one is a new episode with its own age, so separate
bursts never add up to one that "lasted" all along. Reports that do not stand out from the
job's rank-to-rank spread (they blend in) may be the tail of how healthy ranks differ: while
none of an episode's reports has stood out, it reaches back at most two re-arm periods (a
healthy rank's drift flagged on and off for many minutes says nothing about when a real
slowdown began; one report while a real slowdown's level builds up does). Episodes are kept
per GPU: one GPU's report goes on from that GPU's episode or from a node-wide one, never from
another GPU's (a burst on GPU 5 does not make GPU 0's later fault look as old as the burst);
a node-wide report goes on from any of the node's episodes. Reports that cost the job nothing
end the node's episodes and keep episodes of their own (:data:`COSTLESS`), and so do reports of
GPUs that may be a pipeline stage (:data:`STAGE`): a fault or a burst on that node later is a
slowdown of its own, as old as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from slurm_plugin.detection.events import StragglerEvent
from slurm_plugin.detection.params import F64, DetectionParams

#: The episodes of reports that cost the job nothing (a GPU slow in a pipeline stage that
#: waits for a slower one anyway): their own, so that a node slow for an hour where the job
#: did not wait for it is still seen to have been slow that long (node history counts it),
#: while the job's own slowdowns never date from them.
COSTLESS = "compute:costless"

#: The episodes of reports of GPUs that may be a pipeline stage of a small job
#: (``StragglerEvent.maybe_a_stage``): their own, as :data:`COSTLESS`'s.
STAGE = "compute:stage"

#: An open episode: since, the last report's step and time, and whether one stood out.
_Episode = tuple[float, int, float, bool]


@dataclass
class Episodes:
    """The episodes of one job attempt's nodes. ``order`` sorts the ranks by node;
    ``node_starts`` are where each node's ranks begin in that order and ``node_of_group``
    the node of each such run."""

    params: DetectionParams
    node_names: list[str]
    order: np.ndarray
    node_starts: np.ndarray
    node_of_group: np.ndarray
    #: (node, kind) -> per end chart that tells it is over (one GPU's, the node's): when its
    #: slowdown began, step and time of its last report, and whether any report stood out.
    _open: dict[tuple[str, str], dict[tuple[str, int], _Episode]] = field(default_factory=dict)
    #: Per end chart, the current block's rows x columns on which the slowdown was over, the
    #: block's times; and per chart and column the last such time before the block.
    _calm: dict[str, np.ndarray] = field(default_factory=dict)
    _block_ts: F64 = field(default_factory=lambda: np.zeros(0))
    _calm_ts: dict[str, F64] = field(default_factory=dict)

    def block(self, ts: F64, ended: dict[str, np.ndarray]) -> None:
        """The current block's times, and per end chart ("compute:rank", "compute:node",
        "input:node") its rows x columns on which a slowdown there, if any, was over."""
        self._block_ts, self._calm = ts, ended

    def input_calm(self, rank_ratio: F64) -> np.ndarray:
        """Per row and node: every rank's input chart is under its threshold, so a data
        loading excess there, if any, has ended."""
        shape = (rank_ratio.shape[0], len(self.node_names))
        if not len(self.node_names) or not rank_ratio.shape[1]:
            return np.ones(shape, dtype=bool)
        highest = np.maximum.reduceat(rank_ratio[:, self.order], self.node_starts, axis=1)
        most = np.zeros(shape)
        most[:, self.node_of_group] = highest
        calm: np.ndarray = most < 1.0
        return calm

    def close_block(self) -> None:
        """After a block: each column's last calm step, for the blocks to come."""
        rows = len(self._block_ts)
        for kind, calm in self._calm.items():
            if rows:
                last = rows - 1 - np.argmax(calm[::-1], axis=0)
                was = self._calm_ts.get(kind, np.full(calm.shape[1], -np.inf))
                self._calm_ts[kind] = np.where(calm.any(axis=0), self._block_ts[last], was)

    def same_episode(self, event: StragglerEvent, kind: str) -> StragglerEvent:
        """``event`` dated from the start of its episode: that of an earlier report of the
        same slowdown (:meth:`_goes_on`) when it came within two re-arm periods and was not
        seen to end in between. A report that costs the job nothing ends the node's episodes
        and goes on from the node's earlier such reports only (:data:`COSTLESS`)."""
        p = self.params
        loss = event.job_loss_pct
        costless = loss is not None and loss < p.min_job_loss_pct
        if kind == "compute" and (costless or event.maybe_a_stage):
            # The job does not wait for the node (now), or its GPUs may be a stage of the
            # job's design: no slowdown of the job goes on, so nothing it does later dates
            # from here (by-design offsets flagged for hours would otherwise make a later
            # burst look as old as they are).
            self._open.pop((event.node, kind), None)
            kind = COSTLESS if costless else STAGE
        episodes = self._open.setdefault((event.node, kind), {})
        watch = self._watch(event, kind)
        since = event.since_ts
        stood_out = not event.blends_in
        for earlier, (start, step, ts, confirmed) in episodes.items():
            if (
                self._goes_on(earlier, watch)
                and (event.step - step <= 2 * p.rearm_steps or event.ts - ts <= 2 * p.rearm_s)
                and not self._ended_between(earlier, ts, event.ts)
            ):
                since = start if since is None else min(start, since)
                stood_out = stood_out or confirmed
        if not stood_out and since is not None:
            since = max(since, event.ts - 2 * p.rearm_s)  # noise so far: not far back
        start = since if since is not None else event.ts
        episodes[watch] = (start, event.step, event.ts, stood_out)
        return replace(event, since_ts=since) if since != event.since_ts else event

    @staticmethod
    def _goes_on(earlier: tuple[str, int], now: tuple[str, int]) -> bool:
        """A report watched on ``now`` can be the slowdown watched on ``earlier`` going on:
        a GPU's from its own episode or the node's, a node-wide one from any of the node's."""
        return now[0] != "compute:rank" or earlier == now or earlier[0] == "compute:node"

    def _watch(self, event: StragglerEvent, kind: str) -> tuple[str, int]:
        """What tells that ``event``'s slowdown ended: its rank's end chart (one GPU), its
        node's (node-wide), or the node's input charts."""
        if kind == "input":
            return "input:node", self.node_names.index(event.node)
        if event.scope == "gpu" and event.ranks:
            return "compute:rank", int(event.ranks[0])
        return "compute:node", self.node_names.index(event.node)

    def _ended_between(self, watch: tuple[str, int], after: float, before: float) -> bool:
        """The slowdown ``watch`` follows ended after ``after`` and before ``before``."""
        key, index = watch
        calm = self._calm.get(key)
        if calm is None or index >= calm.shape[1]:
            return False
        ts = self._block_ts
        if bool(np.any(calm[:, index] & (ts > after) & (ts < before))):
            return True
        earlier = self._calm_ts.get(key)  # up to the end of the previous block
        return earlier is not None and float(earlier[index]) > after
