"""What the gateway saw of one replica's speed: its recent times to first token and gaps between
tokens, each stamped, so that a rolling update can compare two versions over the same window
(control/canary_judge.py)."""

from __future__ import annotations

import math
import time
from collections import deque

KEEP = 4096  # samples of each kind: minutes of traffic at a replica's pace


class LatencyWindow:
    def __init__(self, keep: int = KEEP):
        self.ttft: deque[tuple[float, float]] = deque(maxlen=keep)  # (when, seconds)
        self.itl: deque[tuple[float, float]] = deque(maxlen=keep)

    def first_token(self, seconds: float, now: float | None = None) -> None:
        self.ttft.append((time.monotonic() if now is None else now, seconds))

    def gap(self, seconds: float, now: float | None = None) -> None:
        self.itl.append((time.monotonic() if now is None else now, seconds))


def since(windows, kind: str, start: float) -> list[float]:
    """The samples of `kind` ("ttft" or "itl") the windows took from `start` on."""
    return [s for w in windows for t, s in getattr(w, kind) if t >= start]


def p99(samples: list[float]) -> float | None:
    """The nearest-rank 99th percentile."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
