"""Failure judgement: after an attempt ended with its replica possibly dead, whether to send the
request elsewhere, continue it, or fail it as poison (see poison.py); and the retry budget that
keeps a sick fleet from being hammered by retries."""

from __future__ import annotations

import asyncio
import logging

from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.proxy.forward import Forward
from shoal.fleet.proxy.poison import PoisonGuard, fingerprint
from shoal.fleet.proxy.upstream import ENCODE_INLINE_BYTES, Attempt, Outcome
from shoal.fleet.replicas.health import HealthMonitor
from shoal.fleet.replicas.table import ReplicaTable

log = logging.getLogger(__name__)


class RetryBudget:
    """Each request earns a fraction of a retry (up to 10 banked); a retry spends one."""

    def __init__(self, per_request: float, metrics: GatewayMetrics):
        self.per_request = per_request
        self.metrics = metrics
        self._tokens = 3.0

    def earn(self) -> None:
        self._tokens = min(10.0, self._tokens + self.per_request)

    def may_retry(self, reason: str) -> bool:
        if self._tokens < 1:
            return False
        self._tokens -= 1
        self.metrics.retries.labels(reason).inc()
        return True


class FailureJudge:
    def __init__(
        self, table: ReplicaTable, health: HealthMonitor, guard: PoisonGuard, metrics: GatewayMetrics
    ):
        self.table = table
        self.health = health
        self.guard = guard
        self.metrics = metrics

    async def fingerprint(self, fwd: Forward) -> str:
        if fwd.fp is None:
            if fwd.size > ENCODE_INLINE_BYTES:
                fwd.fp = await asyncio.to_thread(fingerprint, fwd.path, fwd.body)
            else:
                fwd.fp = fingerprint(fwd.path, fwd.body)
        return fwd.fp

    async def refused_for(self, fwd: Forward) -> float:
        """Seconds for which this request is still refused as poison, or 0."""
        if not self.guard.active:  # nothing held: no need to fingerprint the request at all
            return 0.0
        return self.guard.refused(await self.fingerprint(fwd))

    async def strike(self, fwd: Forward) -> None:
        """The engine failed this request alone (internal_error): a second such failure convicts it."""
        self.guard.strike(await self.fingerprint(fwd))

    async def judge_death(self, fwd: Forward, attempt: Attempt, outcome: Outcome, seen: dict) -> str:
        """After an attempt ended with its replica possibly dead: "retry" (the replica is fine, or
        the request came after the death), "continue" (struck once), or "poison". `seen` maps the
        deaths already judged for this request to their verdict: one verdict per death."""
        r = attempt.replica
        if outcome.kind == "engine_dead":
            # Marked down now, so its other requests fail over at once; they learn from the
            # death record that it was a crash, whichever of them hears of it first.
            self.table.mark_down(r.name, f"engine died: {outcome.message}")
            death = r.death
            death.engine_dead = True
        elif outcome.kind == "interrupted":
            death = r.death
        else:
            death = await self.health.fate(r)
        if death is None:
            return "retry"
        key = id(death)
        if key not in seen:
            if death.suspects and attempt not in death.suspects:
                seen[key] = "retry"  # it reached a replica that was already dead
            else:
                fp = await self.fingerprint(fwd)
                poison = self.guard.judge(fp, death, attempt, outcome.kind == "engine_dead")
                seen[key] = "poison" if poison else "continue"
                if poison:
                    self.metrics.poison.inc()
                    log.warning("poison request %s: %s died under it (%s)", fp[:12], r.name, death.reason)
        return seen[key]
