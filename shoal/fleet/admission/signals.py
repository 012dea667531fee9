"""The demand signals that admission records and the autoscaler reads, per model (None: a
one-model fleet): requests waiting at the gateway for a replica, when the last request came, and
recent TTFTs."""

from __future__ import annotations

import time
from collections import deque


class DemandSignals:
    def __init__(self):
        self.queued: dict[str | None, int] = {}
        self.last_request: dict[str | None, float] = {}
        self._ttfts: dict[str | None, deque] = {}

    def asked(self, model: str | None, at: float) -> None:
        self.last_request[model] = at

    def waiting(self, model: str | None, delta: int) -> None:
        self.queued[model] = self.queued.get(model, 0) + delta

    def observe_ttft(self, model: str | None, seconds: float) -> None:
        self._ttfts.setdefault(model, deque(maxlen=512)).append((time.monotonic(), seconds))

    def ttft_p90(self, model: str | None, since: float) -> float | None:
        recent = sorted(t for at, t in self._ttfts.get(model, ()) if at >= since)
        return recent[int(0.9 * (len(recent) - 1))] if recent else None
