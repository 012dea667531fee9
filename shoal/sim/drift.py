"""A host's speed as it drifted over a run, read from its engines' traced steps: the simulator
replaying that run prices each step at the speed of its moment, not at the run's mean.

A shared host's speed moves by 10-20 % over minutes. Where a fleet runs near its capacity, the
queue follows the speed of each stretch of the run, not their mean: in a P/D run here (README, run
44) both workers ran x1.11-1.17 their price over the first 45 s and x1.02-1.05 later, and the
simulator at the run's mean speed gave its first half's requests TTFTs 30-60 % short and its last
ones 10-40 % long."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.engine.step_shape import StepShape
from shoal.sim.profile import NodeProfile

WINDOW_S = 15.0  # long against a step (a 2,048-token prompt step: 3-4 s here), short against drift
# A window whose steps are priced at less than this is too few steps to read: it runs at the mean.
MIN_PRICED_S = 1.0


@dataclass(frozen=True)
class SpeedDrift:
    """How many times the run's mean speed the host ran at, window by window from its start."""

    factors: tuple[float, ...]
    window_s: float = WINDOW_S

    def at(self, t: float) -> float:
        """The factor at `t` seconds into the run (past the last window: the last)."""
        if not self.factors:
            return 1.0
        return self.factors[min(max(0, int(t // self.window_s)), len(self.factors) - 1)]

    @classmethod
    def traced(
        cls,
        profile: NodeProfile,
        steps: list[tuple[StepShape, float, float]],
        start: float,
        window_s: float = WINDOW_S,
    ) -> SpeedDrift:
        """From steps (shape, seconds, when it ended; read_timed_steps) that engines of one role ran
        in a run that began at `start` on the same clock: each window's steps' seconds over their
        prices, against all of them."""
        timed = [(shape, seconds, ended) for shape, seconds, ended in steps if ended is not None]
        if not timed:
            return cls((), window_s)
        sums: dict[int, list[float]] = {}
        for shape, seconds, ended in timed:
            w = max(0, math.floor((ended - seconds - start) / window_s))
            took = sums.setdefault(w, [0.0, 0.0])
            took[0] += seconds
            took[1] += profile.step_seconds(shape)
        mean = sum(t for t, _ in sums.values()) / sum(p for _, p in sums.values())
        factors = [
            (sums[w][0] / sums[w][1]) / mean if w in sums and sums[w][1] >= MIN_PRICED_S else 1.0
            for w in range(max(sums) + 1)
        ]
        return cls(tuple(factors), window_s)

    def without(self, stretch: list[float], mean_stretch: float) -> SpeedDrift:
        """This drift less what the simulator itself stretched each window's steps by against its
        mean (`stretch`: its steps' time over their price by window; shared cores, loading handed
        K/V), which the real steps' time held too: counted once."""
        factors = [
            f / (stretch[w] / mean_stretch) if w < len(stretch) and stretch[w] > 0 else f
            for w, f in enumerate(self.factors)
        ]
        return SpeedDrift(tuple(factors), self.window_s)
