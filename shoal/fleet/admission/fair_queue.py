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

import asyncio
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
    wake: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set: look again
    _queue: deque | None = field(default=None, repr=False)


class FairQueue:
    def __init__(self, weights: dict[str, float] | None = None):
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = dict(weights or {})  # tenant -> its fair-share weight
        # model -> priority -> tenant -> waiters in arrival order
        self._waiting: dict[str | None, dict[int, dict[str, deque[Waiter]]]] = {}
        self._backlog: dict[str, int] = {}  # tenant -> its waiters, every model
        self._seq = itertools.count()
        # The waiters whose turn it is, for (model, free slots, version): every waiter wakes at
        # each change, and all but the first find the answer here instead of walking the queue.
        self._version = 0
        self._bypassing = 0  # bypass waiters queued (rare: only then are queues searched for them)
        self._turn_key: tuple | None = None
        self._turn: set[Waiter] = set()

    def charge(self, tenant: str, tokens: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.weights.get(tenant, 1.0)
        self._version += 1

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
        self._bypassing += w.bypass
        self._version += 1
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
        self._bypassing -= w.bypass
        self._version += 1
        if not q:
            by_tenant = self._waiting[w.model][w.priority]
            del by_tenant[w.tenant]
            if not by_tenant:
                del self._waiting[w.model][w.priority]
                if not self._waiting[w.model]:
                    del self._waiting[w.model]

    def evict_for(self, newcomer: Waiter) -> Waiter | None:
        """When the queue is full: the newest waiter of the tenant holding the most places, if that
        tenant holds more than the newcomer's would with one more (a flood cannot fill the queue
        and so turn everyone else away). Only a waiter that runs no sooner than the newcomer and
        was not admitted already (a retry, a continuation) gives way. None: turn the newcomer away."""
        if not self._backlog:
            return None
        most = max(self._backlog, key=self._backlog.get)
        if self._backlog[most] <= self._backlog.get(newcomer.tenant, 0) + 1:
            return None
        newest = None
        for by_priority in self._waiting.values():
            for p, by_tenant in by_priority.items():
                for w in reversed(by_tenant.get(most, ())) if p >= newcomer.priority else ():
                    if not w.bypass and (newest is None or w.seq > newest.seq):
                        newest = w
                        break
        if newest is not None:
            self.leave(newest)
            newest.evicted = True
            newest.wake.set()
        return newest

    def models(self) -> list[str | None]:
        return list(self._waiting)

    def everyone(self):
        for by_priority in self._waiting.values():
            for by_tenant in by_priority.values():
                for q in by_tenant.values():
                    yield from q

    def to_wake(self, model: str | None, slots: int) -> set[Waiter]:
        """Who may get a replica of `model` when `slots` are free: those in turn, each tenant's
        first waiter (it may be within its share), and retries and continuations (not held back).
        The rest sleep: waking every waiter at every release would cost the event loop the square
        of the queue's length."""
        out = set(itertools.islice((x for x in self.order(model) if not x.bypass), max(1, slots)))
        for by_tenant in self._waiting.get(model, {}).values():
            for q in by_tenant.values():
                out.add(q[0])
                if self._bypassing:
                    out.update(x for x in q if x.bypass)
        return out

    def in_turn(self, w: Waiter, slots: int) -> bool:
        """Whether `w` is among the first `slots` waiters of its model in service order."""
        key = (w.model, slots, self._version)
        if self._turn_key != key:
            self._turn_key = key
            self._turn = set(itertools.islice((x for x in self.order(w.model) if not x.bypass), slots))
        return w in self._turn

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
