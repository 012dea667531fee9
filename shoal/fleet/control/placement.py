"""Placing replicas within the node's memory budget. Each model says what one of its replicas
takes (`memory_mb`); a replica that does not fit waits, and when memory is short the least
recently used idle model that may scale to zero is unloaded (its standbys stopped, its idle
replicas drained) until its next request."""

from __future__ import annotations

import logging

from shoal.fleet.control.replica_set import Lifecycle, Pool

log = logging.getLogger(__name__)


class Placement:
    def __init__(self, controller, budget_mb: float | None):
        self.c = controller
        self.budget_mb = budget_mb

    def used_mb(self) -> float:
        return sum(s.model.memory_mb for p in self.c.pools for s in p.slots)

    def fits(self, pool: Pool) -> bool:
        return self.budget_mb is None or self.used_mb() + pool.model.memory_mb <= self.budget_mb

    def make_room(self, pool: Pool, now: float) -> None:
        """Unloads the least recently used idle model (not `pool`'s), if there is one."""
        reg = self.c.registry
        candidates = [
            p
            for p in self.c.pools
            if p.model.name != pool.model.name
            and p.autoscaler is not None
            and p.min == 0
            and p.evicted_at is None
            and p.slots
            and not reg.queued.get(p.model.name)
            and all(reg.replicas[s.name].inflight == 0 for s in p.slots if s.name in reg.replicas)
        ]
        if not candidates:
            return
        victim = min(candidates, key=lambda p: reg.last_request.get(p.model.name, 0.0))
        victim.evicted_at = now
        victim.desired = 0
        log.warning(
            "memory: %.0f of %.0f MiB used; unloading idle %s to place %s",
            self.used_mb(),
            self.budget_mb,
            victim.key,
            pool.key,
        )
        reg.metrics.unloads.labels(victim.key).inc()
        for s in victim.in_state(Lifecycle.STARTING, Lifecycle.STANDBY):
            self.c.stop_slot(s, "unloaded for memory")
        for s in victim.in_state(Lifecycle.READY):
            self.c.set_state(s, Lifecycle.DRAINING, "unloaded for memory")
