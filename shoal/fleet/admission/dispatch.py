"""Dispatch: a request waits its turn in the fair queue, takes a replica its routing policy picks,
and gives it back when it ends (which feeds the replica's circuit breaker)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from shoal.fleet.admission.canary import CanarySplit
from shoal.fleet.admission.fair_queue import FairQueue, Waiter
from shoal.fleet.admission.shares import FairShares
from shoal.fleet.admission.signals import DemandSignals
from shoal.fleet.config import GatewayConfig
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.replica import SERVING_ROLES, Replica
from shoal.fleet.replicas.table import ReplicaTable
from shoal.fleet.routing.adapters import AdapterDirectory
from shoal.fleet.routing.policies import Policy, RouteRequest
from shoal.protocol import tracing

log = logging.getLogger(__name__)


class NoReplicaError(Exception):
    """No replica can take the request now (none ready, or all full past the queue bound)."""


class ReplicaLease:
    """A replica held for one try of one request: given back once, with the verdict its holder
    reached (see Dispatcher.release). Should the holder be cut short before it has one (its client
    left and the stream was cancelled, or the gateway's own error), `held_until_given_back` gives
    it back as abandoned, so that no slot stays taken and the try counts neither way."""

    def __init__(self, dispatch: Dispatcher, replica: Replica):
        self.dispatch = dispatch
        self.replica = replica
        self.held = True

    def give_back(
        self, ok: bool | None, reason: str = "", failed: bool = False, abandoned: bool = False
    ) -> None:
        if self.held:
            self.held = False
            self.dispatch.release(self.replica, ok, reason, failed, abandoned)

    def abandon(self) -> None:
        """Gives it back with no outcome (see Dispatcher.release's `abandoned`)."""
        self.give_back(None, abandoned=True)

    @contextlib.contextmanager
    def held_until_given_back(self):
        try:
            yield self
        except BaseException:
            self.abandon()
            raise


class Dispatcher:
    def __init__(
        self,
        config: GatewayConfig,
        table: ReplicaTable,
        policy: Policy,
        index: PrefixIndex,
        metrics: GatewayMetrics,
        fair: FairQueue,
        shares: FairShares,
        demand: DemandSignals,
        canary: CanarySplit,
        cold_start: Callable[[str | None], bool],
        adapters: AdapterDirectory,
    ):
        self.config = config
        self.table = table
        self.policy = policy
        self.index = index
        self.metrics = metrics
        self.fair = fair  # the order of requests waiting for a replica
        self.shares = shares
        self.demand = demand
        self.canary = canary
        self.cold_start = cold_start  # whether a model with no replica up gets one if we wait
        self.adapters = adapters  # which replicas a request for an adapter may go to
        self._waiters = 0

    async def lease(self, req: RouteRequest, exclude: set[str], **kw) -> ReplicaLease:
        """`acquire`, held as a ReplicaLease."""
        return ReplicaLease(self, await self.acquire(req, exclude, **kw))

    async def acquire(
        self,
        req: RouteRequest,
        exclude: set[str],
        roles: frozenset = SERVING_ROLES,
        timeout: float | None = None,
        only_roles: bool = False,
    ) -> Replica:
        """`_acquire`, traced: the span covers the wait in the queue and the routing decision."""
        with tracing.child("gateway.route", req.span, **{"shoal.roles": ",".join(sorted(roles))}) as span:
            replica = await self._acquire(req, exclude, roles, timeout, only_roles)
            span.set_attribute("shoal.replica", replica.name)
            return replica

    async def _acquire(
        self,
        req: RouteRequest,
        exclude: set[str],
        roles: frozenset,
        timeout: float | None,
        only_roles: bool,
    ) -> Replica:
        """A replica of the request's model, waiting in the bounded fair queue while all are at their
        cap, and up to cold_start_timeout_s while the controller brings one to a model that has none.
        Replicas of `roles` first; others only when none of those is routable (unless `only_roles`).

        While others wait, a request takes a free replica only in its turn (see fair_queue.py);
        retries and prefill-only acquires are not held back (they were admitted once already)."""
        cfg = self.config
        start = time.monotonic()
        deadline = start + (cfg.queue_timeout_s if timeout is None else timeout)
        model = req.model
        if not only_roles:
            self.demand.asked(model, start)
        tenant = req.tenant if cfg.fair_queuing else ""  # one queue: arrival order
        waiter = Waiter(model, tenant, req.priority, bypass=bool(exclude) or only_roles)
        queued = cold = False
        try:
            # Every check below runs without an await, so it is atomic on the event loop.
            while True:
                if waiter.evicted:
                    raise NoReplicaError("the queue is full, and this tenant's requests hold the most of it")
                now = time.monotonic()
                routable = [
                    r
                    for r in self.table.replicas.values()
                    if r.name not in exclude and r.model == model and r.routable(now)
                ]
                preferred = [r for r in routable if r.role in roles]
                if preferred or only_roles:
                    routable = preferred
                adapter_wait = False
                if req.adapter is not None and routable:
                    routable = self.adapters.narrow(routable, req.adapter)
                    # None holds it and one is loading it (narrow saw to that): wait for it.
                    adapter_wait = not routable and self.adapters.loading(req.adapter)
                if not routable and not cold and not adapter_wait:
                    if only_roles or not self.cold_start(model):
                        raise NoReplicaError("no replica is ready")
                    cold = True  # one is starting or standing by: wait for it, not 503
                    deadline = start + cfg.cold_start_timeout_s
                cap = cfg.max_inflight_per_replica
                within = self.shares.within(req, len(routable) * cap)
                if within:
                    cap *= 2  # past the cap, not past twice it
                free = [r for r in routable if r.inflight < cap]
                if free and not (waiter.bypass or within) and self.fair.waiting(model):
                    if not queued:
                        self.fair.join(waiter)  # others wait: take a place among them
                    slots = sum(cap - r.inflight for r in free)
                    if not self.fair.in_turn(waiter, slots):
                        free = []
                if free:
                    if cold:
                        self.metrics.cold_start_wait.labels(model or "default").observe(now - start)
                    if not waiter.bypass:
                        self.metrics.tenant_queue.labels(req.tenant).observe(now - start)
                        if not req.charged:
                            req.charged = True
                            self.fair.charge(req.tenant, req.tokens)
                    replica = self._dispatch(self.policy.choose(self.canary.split(model, free), req), req)
                    if queued:
                        self.wake()  # the next in line may have a slot too
                    return replica
                if not queued:
                    if self._waiters >= cfg.max_queue and self.fair.evict_for(waiter) is None:
                        raise NoReplicaError("every replica is at its concurrency cap and the queue is full")
                    queued = True
                    self._waiters += 1
                    self.demand.waiting(model, +1)
                    self.metrics.queued.labels(model or "default").inc()
                    if waiter._queue is None:
                        self.fair.join(waiter)
                remaining = deadline - now
                if remaining <= 0:
                    what = "a replica to start" if cold else "a free replica"
                    raise NoReplicaError(f"timed out waiting for {what}")
                waiter.wake.clear()
                # Woken when its turn may have come; the timeout only backs up a missed wake.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.wake.wait(), min(remaining, 1.0))
        finally:
            self.fair.leave(waiter)
            if queued:
                self._waiters -= 1
                self.demand.waiting(model, -1)
                self.metrics.queued.labels(model or "default").dec()

    def _dispatch(self, choice: tuple[Replica, str], req: RouteRequest) -> Replica:
        replica, reason = choice
        replica.on_dispatch()
        self.metrics.decisions.labels(self.policy.name, reason).inc()
        self.metrics.requests.labels(replica.name).inc()
        self.metrics.inflight.labels(replica.name).set(replica.inflight)
        if req.hashes:
            held = self.index.matched_blocks(req.hashes, [replica.name])
            req.cached_blocks = held[replica.name]
            self.index.routed(replica.name, req.hashes)
        return replica

    def release(
        self, r: Replica, ok: bool | None, reason: str = "", failed: bool = False, abandoned: bool = False
    ) -> None:
        """Ends a request on `r`: ok counts for it, False against it (the circuit breaker), None
        neither (a timeout on a replica that still passes probes). `failed`: the request failed
        there all the same (a 503, a 500 of its own, a timeout), which a rolling update counts.
        `abandoned`: the gateway stopped it before the replica said how it went, so a rolling
        update counts it neither as finished nor as failed there.
        Never awaits: a cancelled stream's cleanup calls it, and anyio would cancel each await."""
        r.inflight -= 1
        r.failed_total += int(failed or ok is False)
        r.abandoned_total += int(abandoned)
        self.metrics.inflight.labels(r.name).set(r.inflight)
        if ok:
            r.on_success()
        elif ok is None:
            r.trial_inflight = False
        elif r.on_failure(reason, self.config.eject_after_errors, self.config.eject_for_s):
            self.metrics.ejections.labels(r.name).inc()
            log.warning("replica %s ejected after: %s", r.name, reason)
        self.wake()

    def wake(self, everyone: bool = False) -> None:
        """Wakes the waiters that may now get a replica (see FairQueue.to_wake), or all of them
        (a replica came or went)."""
        if everyone:
            for w in list(self.fair.everyone()):
                w.wake.set()
            return
        cap = self.config.max_inflight_per_replica
        now = time.monotonic()
        for model in self.fair.models():
            slots = sum(max(0, cap - r.inflight) for r in self.table.routable(model, now))
            for w in self.fair.to_wake(model, slots):
                w.wake.set()

    def notify_nowait(self) -> None:
        """Wakes requests waiting for a replica (one was promoted, or became free)."""
        self.wake(everyone=True)

    def charge(self, tenant: str, tokens: int) -> None:
        """Tokens served to `tenant` beyond what it was charged at dispatch (its completion)."""
        self.fair.charge(tenant, tokens)

    # --- what the batch lane reads -------------------------------------------------------

    def spare_slots(self, model: str | None) -> int:
        """Free request slots on the model's ready serving replicas, less the requests waiting here."""
        cap = self.config.max_inflight_per_replica
        free = sum(max(0, cap - r.inflight) for r in self.table.serving(model, time.monotonic()))
        return free - self.fair.waiting(model)

    def waiting(self, model: str | None) -> int:
        return self.fair.waiting(model)

    def waiting_below(self, model: str | None, priority: int) -> int:
        return self.fair.waiting_below(model, priority)

    def may_start(self, model: str | None) -> bool:
        """Whether a request for `model` with no free replica may be tried: the model has no
        replica here to measure (scaled to zero, or routed some other way), or one would start."""
        unknown = not any(r.model == model for r in self.table.replicas.values())
        return unknown or self.cold_start(model)
