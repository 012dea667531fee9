"""The order in which requests waiting for a replica are served.

Lower priority values first (interactive before batch). Within a priority, the tenant with the
least weighted service so far goes first: a virtual token counter per tenant grows by the tokens
served to it (prompt at dispatch, completion when it ends) divided by its weight (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024). A tenant that starts waiting again is
brought within the counters of those already waiting: lifted to the least of them, so idling
banks no credit (VTC's rule), and lowered to the greatest of them, so service it had while no one
else wanted any (work-conserving, not taken from anyone) is no debt either. Within a tenant,
first come first served. A flooding tenant's counter runs ahead, and so it waits behind everyone
else's requests, not they behind its.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field


@dataclass(eq=False)
class Waiter:
    model: str | None
    tenant: str
    priority: int
    seq: int = 0
    bypass: bool = False  # a retry or a prefill-only acquire: not held back by others' turns
    evicted: bool = False  # pushed out of a full queue to make room for another tenant's request
    _queue: deque | None = field(default=None, repr=False)


class FairQueue:
    def __init__(self):
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        # model -> priority -> tenant -> waiters in arrival order
        self._waiting: dict[str | None, dict[int, dict[str, deque[Waiter]]]] = {}
        self._backlog: dict[str, int] = {}  # tenant -> its waiters, every model
        self._seq = itertools.count()

    def charge(self, tenant: str, tokens: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.weights.get(tenant, 1.0)

    def waiting(self, model: str | None) -> int:
        return sum(len(q) for by_tenant in self._waiting.get(model, {}).values() for q in by_tenant.values())

    def waiting_below(self, model: str | None, priority: int) -> int:
        """Waiters of `model` that run before `priority` (a lower value)."""
        return sum(
            len(q)
            for p, by_tenant in self._waiting.get(model, {}).items()
            if p < priority
            for q in by_tenant.values()
        )

    def join(self, w: Waiter) -> None:
        if not self._backlog.get(w.tenant):
            active = [self.counters.get(t, 0.0) for t, n in self._backlog.items() if n]
            if active:
                own = self.counters.get(w.tenant, 0.0)
                self.counters[w.tenant] = min(max(own, min(active)), max(active))
        self._backlog[w.tenant] = self._backlog.get(w.tenant, 0) + 1
        w.seq = next(self._seq)
        q = self._waiting.setdefault(w.model, {}).setdefault(w.priority, {}).setdefault(w.tenant, deque())
        q.append(w)
        w._queue = q

    def leave(self, w: Waiter) -> None:
        q = w._queue
        if q is None:
            return
        w._queue = None
        q.remove(w)
        self._backlog[w.tenant] -= 1
        if not q:
            by_tenant = self._waiting[w.model][w.priority]
            del by_tenant[w.tenant]
            if not by_tenant:
                del self._waiting[w.model][w.priority]
                if not self._waiting[w.model]:
                    del self._waiting[w.model]

    def evict_for(self, tenant: str) -> Waiter | None:
        """When the queue is full: the newest waiter of the tenant holding the most places, if that
        tenant holds more than `tenant` would with one more (a flood cannot fill the queue and so
        turn everyone else away). None: `tenant` is the one to turn away."""
        if not self._backlog:
            return None
        most = max(self._backlog, key=self._backlog.get)
        if self._backlog[most] <= self._backlog.get(tenant, 0) + 1:
            return None
        newest = None
        for by_priority in self._waiting.values():
            for by_tenant in by_priority.values():
                q = by_tenant.get(most)
                if q and (newest is None or q[-1].seq > newest.seq):
                    newest = q[-1]
        if newest is not None:
            self.leave(newest)
            newest.evicted = True
        return newest

    def ahead(self, w: Waiter, limit: int) -> int:
        """How many waiters of its model come before `w` in service order, counting up to `limit`."""
        n = 0
        for other in self.order(w.model):
            if other is w or n >= limit:
                return n
            if not other.bypass:
                n += 1
        return n

    def order(self, model: str | None):
        """Waiters of `model` in service order."""
        by_priority = self._waiting.get(model, {})
        for p in sorted(by_priority):
            by_tenant = by_priority[p]
            # Round by round, the tenant with the least service; its next waiter, then the next
            # tenant. Within one pass the counters do not change, so this is their sorted merge.
            tenants = sorted(by_tenant, key=lambda t: (self.counters.get(t, 0.0), by_tenant[t][0].seq))
            queues = [iter(list(by_tenant[t])) for t in tenants]
            while queues:
                for it in list(queues):
                    nxt = next(it, None)
                    if nxt is None:
                        queues.remove(it)
                    else:
                        yield nxt
