"""How many active replicas a model's pool should have, from the signals that matter for serving:
requests in flight and queued at the gateway, requests waiting in the engines, KV-cache usage and
TTFT against their targets (not CPU load, which a memory-bound decode hides).

Each signal says how many replicas it needs at its target; the pool needs the most any signal
asks for. Hysteresis keeps it from flapping: a change must be wanted for a while (a short delay
up, a long one down), moves at most `max_step` replicas, a scale-down happens only when the
survivors can absorb the load (the load of N replicas spread on N - 1 stays under target less the
tolerance), and an idle model goes to zero only after its idle period."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.protocol.bounds import check_bounds


@dataclass
class AutoscaleConfig:
    target_inflight: float = 8.0  # requests in flight per active replica (the gateway's count)
    target_waiting: float = 4.0  # requests queued in the engines per active replica
    target_kv_usage: float = 0.8  # mean KV-cache usage of the active replicas
    target_ttft_s: float | None = None  # the model's recent TTFT p90; None: not a signal
    tolerance: float = 0.1  # within target x (1 +- tolerance) nothing changes
    scale_up_delay_s: float = 1.0
    scale_down_delay_s: float = 30.0
    max_step: int = 2  # replicas added or removed by one decision

    def check(self) -> None:
        check_bounds(
            self,
            {"tolerance": 0, "scale_up_delay_s": 0, "scale_down_delay_s": 0, "max_step": 1},
            above={"target_inflight": 0, "target_waiting": 0, "target_kv_usage": 0, "target_ttft_s": 0},
            most={"target_kv_usage": 1},
        )


@dataclass
class Signals:
    active: int  # replicas taking traffic
    inflight: float  # requests in flight on them, at the gateway
    queued: int  # requests waiting at the gateway for a replica of this pool
    waiting: float  # requests queued inside their engines
    kv_usage: float  # mean KV-cache usage of the active replicas (0-1)
    ttft_p90: float | None  # recent TTFT p90, seconds
    idle_s: float  # since the pool last had a request
    desired: int = -1  # active replicas asked for so far (-1: as many as are active)

    def __post_init__(self):
        if self.desired < 0:
            self.desired = self.active


@dataclass
class Decision:
    desired: int
    reason: str  # for people: the log and the status page
    changed: bool
    signal: str = ""  # for the metric: inflight, waiting, kv_usage, ttft, idle, cold_start


class Autoscaler:
    def __init__(
        self, config: AutoscaleConfig, min_replicas: int, max_replicas: int, idle_to_zero_s: float | None
    ):
        self.config = config
        self.min = min_replicas
        self.max = max_replicas
        self.idle_to_zero_s = idle_to_zero_s
        self._want_since: dict[str, float] = {}  # direction -> when it was first wanted

    def need(self, s: Signals) -> tuple[float, str]:
        """Replicas the load needs at target (fractional), and the signal that decided it."""
        c = self.config
        demand = s.inflight + s.queued
        needs = {
            "inflight": demand / c.target_inflight,
            "waiting": s.waiting / c.target_waiting,
            "kv_usage": s.active * s.kv_usage / c.target_kv_usage,
        }
        if c.target_ttft_s and s.ttft_p90 is not None:
            needs["ttft"] = s.active * s.ttft_p90 / c.target_ttft_s
        signal = max(needs, key=needs.get)
        return needs[signal], signal

    def decide(self, s: Signals, now: float) -> Decision:
        """The active replicas wanted, from the signals and the count asked for before (which
        counts replicas still starting as capacity on its way, so that it does not ask twice)."""
        c = self.config
        need, signal = self.need(s)
        busy = s.inflight + s.queued > 0
        current = max(self.min, min(self.max, s.desired))
        if current == 0:
            # From zero there is nothing to average: a waiting request is reason enough, at once.
            target = min(self.max, max(1, math.ceil(need))) if busy else 0
            self._want_since.clear()
            return Decision(
                target, "cold start" if target else "idle", target > 0, "cold_start" if target else ""
            )
        if self.min == 0 and not busy and self.idle_to_zero_s is not None and s.idle_s >= self.idle_to_zero_s:
            self._want_since.clear()
            return Decision(0, f"idle for {s.idle_s:.0f} s", True, "idle")
        ratio = need / current
        if ratio > 1 + c.tolerance and current < self.max:
            if self._held("up", now, c.scale_up_delay_s):
                target = min(self.max, current + c.max_step, max(current + 1, math.ceil(need)))
                return Decision(target, f"{signal} at {ratio:.2f}x target", True, signal)
            return Decision(current, f"{signal} high, waiting {c.scale_up_delay_s:.0f} s", False)
        self._want_since.pop("up", None)
        # Down only if N - 1 replicas would carry this load under target less the tolerance.
        floor = max(self.min, 1)
        if current > floor and need / (current - 1) < 1 - c.tolerance:
            if self._held("down", now, c.scale_down_delay_s):
                target = max(floor, current - c.max_step, math.ceil(need / (1 - c.tolerance)))
                return Decision(target, f"{signal} at {ratio:.2f}x target", True, signal)
            return Decision(current, f"{signal} low, waiting {c.scale_down_delay_s:.0f} s", False)
        self._want_since.pop("down", None)
        return Decision(current, "steady", current != s.desired)

    def _held(self, direction: str, now: float, delay: float) -> bool:
        """Whether a change in `direction` has been wanted for `delay` (and starts its clock)."""
        for other in ("up", "down"):
            if other != direction:
                self._want_since.pop(other, None)
        since = self._want_since.setdefault(direction, now)
        if now - since >= delay:
            del self._want_since[direction]
            return True
        return False
