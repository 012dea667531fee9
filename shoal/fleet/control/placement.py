"""Placing replicas within the node's memory budget. Each model says what one of its replicas
takes (`memory_mb`); a replica that does not fit waits, and when memory is short the least
recently used idle model that may scale to zero is unloaded (its standbys stopped, its idle
replicas drained) until its next request."""

from __future__ import annotations

import logging

from shoal.fleet.admission.signals import DemandSignals
from shoal.fleet.control.replica_set import Lifecycle, Pool, ReplicaSet
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.replicas.table import ReplicaTable

log = logging.getLogger(__name__)


class Placement:
    def __init__(
        self,
        replica_set: ReplicaSet,
        table: ReplicaTable,
        demand: DemandSignals,
        metrics: GatewayMetrics,
        budget_mb: float | None,
    ):
        self.rs = replica_set
        self.table = table
        self.demand = demand
        self.metrics = metrics
        self.budget_mb = budget_mb

    def used_mb(self) -> float:
        return sum(s.model.memory_mb for p in self.rs.pools for s in p.slots)

    def fits(self, pool: Pool) -> bool:
        return self.budget_mb is None or self.used_mb() + pool.model.memory_mb <= self.budget_mb

    def make_room(self, pool: Pool, now: float) -> None:
        """Unloads the least recently used idle model (not `pool`'s), if there is one."""
        reps = self.table.replicas
        candidates = [
            p
            for p in self.rs.pools
            if p.model.name != pool.model.name
            and p.autoscaler is not None
            and p.min == 0
            and p.evicted_at is None
            and p.slots
            and not self.demand.queued.get(p.model.name)
            and all(reps[s.name].inflight == 0 for s in p.slots if s.name in reps)
        ]
        if not candidates:
            return
        victim = min(candidates, key=lambda p: self.demand.last_request.get(p.model.name, 0.0))
        victim.evicted_at = now
        victim.desired = 0
        log.warning(
            "memory: %.0f of %.0f MiB used; unloading idle %s to place %s",
            self.used_mb(),
            self.budget_mb,
            victim.key,
            pool.key,
        )
        self.metrics.unloads.labels(victim.key).inc()
        for s in victim.in_state(Lifecycle.STARTING, Lifecycle.STANDBY):
            self.rs.stop_slot(s, "unloaded for memory")
        for s in victim.in_state(Lifecycle.READY):
            self.rs.set_state(s, Lifecycle.DRAINING, "unloaded for memory")
