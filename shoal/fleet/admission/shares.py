"""Fair shares of a model's request slots among the tenants that want some: a tenant within its
weighted share skips the queue (up to twice a replica's cap), one past it runs just after its
class in the engine (see Pipeline.engine_priority)."""

from __future__ import annotations

import time

from shoal.fleet.admission.tenants import Tenants
from shoal.fleet.config import GatewayConfig
from shoal.fleet.replicas.table import ReplicaTable
from shoal.fleet.routing.policies import RouteRequest

SHARE_WINDOW_S = 10.0  # a tenant with a request admitted this recently counts in the shares


class FairShares:
    def __init__(self, config: GatewayConfig, tenants: Tenants | None, table: ReplicaTable):
        self.config = config
        self.tenants = tenants  # None: one anonymous tenant, no shares
        self.table = table

    def within(self, req: RouteRequest, slots: int) -> bool:
        """Whether the request's tenant holds no more than its weighted share of the model's slots
        among the tenants that want some (requests in flight, or one admitted lately). Such a
        request does not queue behind others that hold more: it may take a replica up to twice
        its cap."""
        if req.priority >= self.config.batch_priority:
            return False
        return self._share(req.tenant, slots) is True

    def over(self, tenant: str, model: str | None) -> bool:
        """Whether `tenant` holds more than its weighted share of the model's slots while another
        tenant also wants some (see within)."""
        n = len(self.table.serving(model, time.monotonic()))
        return self._share(tenant, max(1, n) * self.config.max_inflight_per_replica) is False

    def _share(self, tenant: str, slots: int) -> bool | None:
        """Within its share (True), past it (False), or no share to speak of (None: fair
        queuing is off, no tenants, or it is alone)."""
        if self.tenants is None or not self.config.fair_queuing:
            return None
        mine = self.tenants.all.get(tenant)
        # A tenant between requests still wants its share: one that sends a request a second must
        # not find the others' work ranked beside its own each time it arrives.
        active = [t for t in self.tenants.all.values() if t.active(SHARE_WINDOW_S)]
        if mine is None or len(active) < 2:
            return None
        # The slots a tenant within its share may use reach twice the cap, and its part of
        # them is its weighted share of all of those: a tenant sending at half its share still
        # holds more requests at once beside a flood than alone, since each takes longer.
        return mine.inflight <= 2 * slots * mine.config.weight / sum(t.config.weight for t in active)
