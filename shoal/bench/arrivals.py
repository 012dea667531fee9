"""When requests arrive: a Poisson process at a base rate, raised during bursts. The serving
benchmark sends by it and the simulator draws by it, so the two see the same load."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Burst:
    start_s: float
    length_s: float
    factor: float  # the arrival rate is this many times the base rate during the burst

    @classmethod
    def parse(cls, text: str) -> Burst:
        """ "START:LENGTH:FACTOR", in seconds from the first arrival."""
        try:
            start, length, factor = (float(x) for x in text.split(":"))
        except ValueError as exc:
            raise ValueError(f"bad burst {text!r}: give START_S:LENGTH_S:FACTOR") from exc
        if start < 0 or length <= 0 or factor <= 0:
            raise ValueError(f"bad burst {text!r}: a start of 0 or more, a length and a factor over 0")
        return cls(start, length, factor)


def rate_at(rate: float, bursts: tuple[Burst, ...] | list[Burst], t: float) -> float:
    factor = 1.0
    for b in bursts:
        if b.start_s <= t < b.start_s + b.length_s:
            factor = max(factor, b.factor)
    return rate * factor


def arrival_times(n: int, rate: float, bursts, rng: random.Random) -> list[float]:
    """n arrival times (the first at 0 without bursts); all at 0 for an infinite rate."""
    if not math.isfinite(rate):
        return [0.0] * n
    peak = rate * max([1.0, *(b.factor for b in bursts)])
    out, t = [], 0.0
    while len(out) < n:  # thinning: a Poisson process of varying rate
        t += rng.expovariate(peak)
        if rng.random() * peak <= rate_at(rate, bursts, t):
            out.append(t)
    return out
