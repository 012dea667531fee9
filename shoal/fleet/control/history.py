"""What the fleet did lately, for the status page: each pool's replicas, demand and latency
sampled once a second, and the autoscaler's decisions with their reasons."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from shoal.fleet.control.autoscaler import Signals
from shoal.fleet.control.replica_set import Lifecycle, Pool

SAMPLE_EVERY_S = 1.0
KEEP_S = 600.0


class FleetHistory:
    def __init__(self):
        self.samples: deque = deque(maxlen=int(KEEP_S / SAMPLE_EVERY_S))
        self.decisions: deque = deque(maxlen=200)
        self._last = 0.0

    def decision(self, pool: str, before: int, after: int, reason: str) -> None:
        self.decisions.append(
            {"time": time.time(), "pool": pool, "from": before, "to": after, "reason": reason}
        )

    def sample(self, pools: list[Pool], signals: Callable[[Pool, float], Signals], now: float) -> None:
        if now - self._last < SAMPLE_EVERY_S:
            return
        self._last = now
        by_key = {}
        for p in pools:
            s = signals(p, now)
            by_key[p.key] = {
                "active": s.active,
                "desired": p.desired,
                "standby": len(p.in_state(Lifecycle.STANDBY)),
                "starting": len(p.in_state(Lifecycle.STARTING)),
                "queued": s.queued,
                "inflight": s.inflight,
                "waiting": s.waiting,
                "kv_usage": round(s.kv_usage, 4),
                "ttft_p90": s.ttft_p90,
            }
        self.samples.append({"time": time.time(), "pools": by_key})
