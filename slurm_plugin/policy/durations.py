"""How long a slowdown that passes by itself goes on: the passing kind of the decision model.

Two kinds of passing slowdown, each with heavy-tailed lengths (Pareto II, shape 1: half end
within the scale, and one that has lasted L is as likely as not to last another L + scale):

- **bursts** (scale ``transient_s``, seconds): a page-cache flush, a daemon, a checkpoint
  writer;
- **fail-slow episodes** (scale ``episode_s``, minutes; ``episode_share`` of the passing
  slowdowns the detector reports): a GPU throttling on heat or power, a congested link, a
  noisy neighbour. Published field studies measure them in tens of minutes (mean ~10 min for
  compute, ~24 min for network, ~72 min in jobs of 512+ GPUs), and most end by themselves.

A slowdown that has lasted L is less and less likely a burst; without the episode kind, one
that lasted ten minutes would be taken for a fault of the rest of the job. The functions here
are the mixture's survival and its moments, conditioned on the slowdown still being on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Passing:
    """The lengths of passing slowdowns: bursts of scale ``burst_s``, and a share
    ``episode_share`` of fail-slow episodes of scale ``episode_s``."""

    burst_s: float
    episode_s: float = 0.0
    episode_share: float = 0.0

    def _kinds(self) -> list[tuple[float, float]]:
        """(weight, scale) of each kind."""
        share = self.episode_share if self.episode_s > 0 else 0.0
        kinds = [(1.0 - share, self.burst_s)]
        return kinds + ([(share, self.episode_s)] if share > 0 else [])

    def on(self, lasted: float) -> float:
        """The chance that a passing slowdown is still on after ``lasted`` seconds."""
        return sum(w * s / (s + lasted) for w, s in self._kinds())

    def _given_on(self, lasted: float) -> list[tuple[float, float]]:
        """(weight, scale) of each kind among the slowdowns still on after ``lasted``."""
        total = self.on(lasted)
        return [(w * s / (s + lasted) / total, s) for w, s in self._kinds()]

    def left(self, lasted: float, horizon: float) -> float:
        """How much longer one still on after ``lasted`` is expected to go on, within
        ``horizon`` seconds (each kind: the integral of its survival, A ln(1 + H / A),
        A = scale + L)."""
        horizon = max(0.0, horizon)
        return sum(
            w * (s + lasted) * math.log1p(horizon / (s + lasted)) for w, s in self._given_on(lasted)
        )

    def square(self, lasted: float, horizon: float) -> float:
        """The mean square of how much longer it goes on, within ``horizon`` (each kind: the
        integral of 2 t times its survival, 2 A (H - A ln(1 + H / A)))."""
        horizon = max(0.0, horizon)
        total = 0.0
        for w, s in self._given_on(lasted):
            age = s + lasted
            total += w * 2.0 * age * (horizon - age * math.log1p(horizon / age))
        return total

    def ends_within(self, lasted: float, window: float) -> float:
        """The chance that one still on after ``lasted`` ends within ``window`` seconds."""
        return 1.0 - self.on(lasted + max(0.0, window)) / self.on(lasted)

    def sure_at(self, prior: float, wanted: float) -> float:
        """The age at which a slowdown is ``wanted`` likely to last (``prior``: before it
        began): where the passing kind's chance of still being on falls to
        ``prior (1 - wanted) / (wanted (1 - prior))``."""
        if wanted <= prior:
            return 0.0
        if wanted >= 1.0:
            return math.inf
        target = prior * (1.0 - wanted) / (wanted * (1.0 - prior))
        if len(self._kinds()) == 1:
            return self.burst_s * (1.0 / target - 1.0)
        low, high = 0.0, 1.0
        while self.on(high) > target:  # survival falls as 1/L: found within ~60 doublings
            low, high = high, 2.0 * high
        for _ in range(60):
            middle = 0.5 * (low + high)
            low, high = (middle, high) if self.on(middle) > target else (low, middle)
        return high
