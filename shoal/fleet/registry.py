"""The replica registry: health probes, load and KV-event polling, admission to replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque

import httpx

from shoal.fleet.config import GatewayConfig
from shoal.fleet.fair_queue import FairQueue, Waiter
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.policies import Policy, RouteRequest
from shoal.fleet.prefix_index import PrefixIndex
from shoal.fleet.replica import Death, Replica, ReplicaState

log = logging.getLogger(__name__)


class NoReplicaError(Exception):
    """No replica can take the request now (none ready, or all full past the queue bound)."""


SHARE_WINDOW_S = 10.0  # a tenant with a request admitted this recently counts in the shares
# Whole requests go to replicas with these roles; prefill workers take them only when none is left.
SERVING_ROLES = frozenset({"both", "decode"})
PREFILL_ROLES = frozenset({"prefill"})


class Registry:
    def __init__(self, config: GatewayConfig, policy: Policy, index: PrefixIndex, metrics: GatewayMetrics):
        self.config = config
        self.policy = policy
        self.index = index
        self.metrics = metrics
        self.replicas: dict[str, Replica] = {}
        self._waiters = 0
        self._tasks: list[asyncio.Task] = []
        self.client: httpx.AsyncClient | None = None
        self.kv_root = 0  # root of the prompt block hashes (the deployment's salt), set by the gateway
        self.controller = None  # the fleet's controller, when it runs the replicas (see controller.py)
        # Per model (None: a one-model fleet), for the autoscaler: requests waiting here for a
        # replica, when the last request came, recent TTFTs.
        self.queued: dict[str | None, int] = {}
        self.last_request: dict[str | None, float] = {}
        self._ttfts: dict[str | None, deque] = {}
        # A rolling update's canary: model -> (its version, the share of requests it takes).
        self.canary: dict[str | None, tuple[int, float]] = {}
        self.fair = FairQueue()  # the order of requests waiting for a replica
        self.tenants = None  # the gateway's Tenants: whose requests are in flight (fair shares)

    def add(self, name: str, url: str, pid: int | None = None, proc_exit=None) -> Replica:
        """A replica, or a new life of one (its process restarted): probes decide when it is ready."""
        r = self.replicas.get(name)
        if r is None:
            r = self.replicas[name] = Replica(name, url.rstrip("/"))
        r.url, r.pid = url.rstrip("/"), pid
        if proc_exit is not None:
            r.proc_exit = proc_exit
            r.state, r.death, r.note, r.probe_misses = ReplicaState.LOADING, None, None, 0
        return r

    def remove(self, name: str) -> None:
        """A replica the controller stopped: gone from routing, its cache from the index."""
        r = self.replicas.pop(name, None)
        if r is not None:
            self.index.reset(name)
            for gauge in (self.metrics.replica_up, self.metrics.inflight):
                with contextlib.suppress(KeyError):
                    gauge.remove(name)

    def observe_ttft(self, model: str | None, seconds: float) -> None:
        self._ttfts.setdefault(model, deque(maxlen=512)).append((time.monotonic(), seconds))

    def ttft_p90(self, model: str | None, since: float) -> float | None:
        recent = sorted(t for at, t in self._ttfts.get(model, ()) if at >= since)
        return recent[int(0.9 * (len(recent) - 1))] if recent else None

    def witness(self, r: Replica, reason: str, exit_code: int | None = None) -> Death:
        """Records (once per life) that `r` died, with the requests in flight on it then."""
        if r.death is None:
            r.death = Death(time.monotonic(), reason, frozenset(r.attempts), exit_code)
        elif exit_code is not None:
            r.death.exit_code = exit_code
        return r.death

    def mark_down(self, name: str, reason: str, exit_code: int | None = None) -> None:
        """Takes a replica out of routing and fails over every request relayed from it at once."""
        r = self.replicas[name]
        if r.state != ReplicaState.DOWN:
            r.recent_errors.append((time.time(), reason))
        r.state = ReplicaState.DOWN
        self.witness(r, reason, exit_code)
        self.index.reset(name)
        for attempt in list(r.attempts):
            attempt.interrupt()

    def port_in_use(self, name: str, note: str) -> None:
        r = self.replicas[name]
        if r.state != ReplicaState.PORT_IN_USE:
            r.recent_errors.append((time.time(), note))
        r.state, r.note, r.pid, r.proc_exit = ReplicaState.PORT_IN_USE, note, None, None
        self.index.reset(name)

    async def fate(self, r: Replica, exit_wait_s: float = 0.5) -> Death | None:
        """After a connection to `r` dropped: whether it died (None: it is alive and well, the
        connection alone failed). A dead process's exit code is waited for briefly: it tells a
        crash from a kill."""
        if r.death is None:
            try:
                health = await self.client.get(r.url + "/health", timeout=self.config.probe_timeout_s)
                alive = health.status_code == 200
            except httpx.HTTPError:
                alive = False
            if alive and r.process_alive:
                return None
            self.mark_down(r.name, "a request's connection dropped and /health failed")
        if r.proc_exit is not None and r.death.exit_code is None:
            deadline = time.monotonic() + exit_wait_s
            while (code := r.proc_exit()) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if code is not None:
                r.death.exit_code = code
        return r.death

    # --- background loops ----------------------------------------------------------------

    async def start(self) -> None:
        key = self.config.replica_key
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(2.0),
            limits=httpx.Limits(max_connections=64),
            headers={"authorization": f"Bearer {key}"} if key else None,
        )
        self._tasks = [
            asyncio.create_task(self._every(self.config.probe_interval_s, self._probe)),
            asyncio.create_task(self._every(self.config.load_poll_interval_s, self._poll_load)),
            asyncio.create_task(self._every(self.config.kv_poll_interval_s, self._poll_kv)),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.client is not None:
            await self.client.aclose()

    async def _every(self, interval: float, fn) -> None:
        while True:
            replicas = list(self.replicas.values())
            await asyncio.gather(*(fn(r) for r in replicas), return_exceptions=True)
            waiting: dict[str, float] = {}
            for r in replicas:
                up = r.state == ReplicaState.READY
                self.metrics.replica_up.labels(r.name).set(1 if up else 0)
                waiting[r.role] = waiting.get(r.role, 0) + (r.load.get("waiting", 0) if up else 0)
            for role, n in waiting.items():
                self.metrics.role_waiting.labels(role).set(n)
            await asyncio.sleep(interval)

    async def _probe(self, r: Replica) -> None:
        """Active checks: /health says alive, /ready says loaded. The circuit breaker is left to
        passive checks, since a replica can pass probes and still fail requests.

        A replica the fleet started is only ever probed while its own process runs: after a crash
        of the supervisor, an orphan of the old fleet may still answer on the port, and what
        answers there is not ours to route to."""
        if r.state == ReplicaState.PORT_IN_USE:
            return
        if not r.process_alive:
            if r.state != ReplicaState.DOWN:
                self.mark_down(r.name, f"process exited with {r.proc_exit()}", r.proc_exit())
            return
        timeout = self.config.probe_timeout_s
        try:
            health = await self.client.get(r.url + "/health", timeout=timeout)
            ready = (
                await self.client.get(r.url + "/ready", timeout=timeout)
                if health.status_code == 200
                else None
            )
        except httpx.TimeoutException as exc:
            # Frozen (SIGSTOP, a stuck event loop) or just slow: down after a few misses in a row.
            r.probe_misses += 1
            if r.probe_misses >= self.config.probe_misses and r.state != ReplicaState.DOWN:
                self.mark_down(r.name, f"probe: {type(exc).__name__} {r.probe_misses} times")
            return
        except httpx.HTTPError as exc:  # refused or reset: nothing serves there now
            if r.state == ReplicaState.LOADING and r.proc_exit is not None:
                return  # our process, still starting
            if r.state != ReplicaState.DOWN:
                self.mark_down(r.name, f"probe: {type(exc).__name__}")
            return
        r.probe_misses = 0
        if not r.process_alive:
            return  # it exited while the probe ran: whatever answered is not ours
        if health.status_code != 200:
            if r.state == ReplicaState.LOADING:
                r.note = f"/health {health.status_code}: {health.text[:200]}"  # e.g. the model failed to load
            elif r.state != ReplicaState.DOWN:
                self.mark_down(r.name, f"probe: /health {health.status_code}")
            return
        is_ready = ready is not None and ready.status_code in (200, 404)  # 404: a server without /ready
        if r.state in (ReplicaState.DOWN, ReplicaState.LOADING):
            r.state = ReplicaState.READY if is_ready else ReplicaState.LOADING
            if is_ready:
                r.consecutive_failures = 0
                r.death, r.note = None, None  # a new life
                self.wake(everyone=True)
        elif not is_ready and r.state == ReplicaState.READY:
            r.state = ReplicaState.LOADING

    async def _poll_load(self, r: Replica) -> None:
        if r.state in (ReplicaState.DOWN, ReplicaState.PORT_IN_USE) or r.load.get("unsupported"):
            return
        try:
            resp = await self.client.get(r.url + "/load", timeout=1.0)
        except httpx.HTTPError:
            return
        if resp.status_code == 404:
            r.load = {"unsupported": True}
        elif resp.status_code == 200:
            r.load = resp.json()
            role = r.load.get("role")
            if isinstance(role, str):
                r.role = role

    async def _poll_kv(self, r: Replica) -> None:
        if r.state in (ReplicaState.DOWN, ReplicaState.PORT_IN_USE):
            return
        try:
            resp = await self.client.get(r.url + "/kv_events", params={"after": r.kv_cursor}, timeout=1.0)
        except httpx.HTTPError:
            return
        if resp.status_code != 200:
            r.kv_events = False
            return
        data = resp.json()
        r.kv_events = True
        r.block_size = data.get("block_size", r.block_size)
        if data["instance"] != r.kv_instance or data["reset"]:
            # A new process or a gap: what we knew of its cache is void.
            self.index.reset(r.name)
            if data["instance"] != r.kv_instance:
                r.kv_instance, r.kv_cursor = data["instance"], 0
                return
        for ev in data["events"]:
            if ev["kind"] == "stored":
                self.index.stored(r.name, ev["block_hash"])
            else:
                self.index.removed(r.name, ev["block_hash"])
        r.kv_cursor = data["next"]

    # --- admission -----------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        sizes = {r.block_size for r in self.replicas.values() if r.block_size}
        return sizes.pop() if len(sizes) == 1 else self.config.block_size

    def has_role(self, roles: frozenset) -> bool:
        return any(r.role in roles for r in self.replicas.values())

    async def acquire(
        self,
        req: RouteRequest,
        exclude: set[str],
        roles: frozenset = SERVING_ROLES,
        timeout: float | None = None,
        only_roles: bool = False,
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
            self.last_request[model] = start
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
                    for r in self.replicas.values()
                    if r.name not in exclude and r.model == model and r.routable(now)
                ]
                preferred = [r for r in routable if r.role in roles]
                if preferred or only_roles:
                    routable = preferred
                if not routable and not cold:
                    if only_roles or self.controller is None or not self.controller.wake(model):
                        raise NoReplicaError("no replica is ready")
                    cold = True  # one is starting or standing by: wait for it, not 503
                    deadline = start + cfg.cold_start_timeout_s
                cap = cfg.max_inflight_per_replica
                within = self._within_share(req, len(routable) * cap)
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
                    replica = self._dispatch(self.policy.choose(self._canary_split(model, free), req), req)
                    if queued:
                        self.wake()  # the next in line may have a slot too
                    return replica
                if not queued:
                    if self._waiters >= cfg.max_queue and self.fair.evict_for(waiter) is None:
                        raise NoReplicaError("every replica is at its concurrency cap and the queue is full")
                    queued = True
                    self._waiters += 1
                    self.queued[model] = self.queued.get(model, 0) + 1
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
                self.queued[model] -= 1

    def _within_share(self, req: RouteRequest, slots: int) -> bool:
        """Whether the request's tenant holds no more than its weighted share of the model's slots
        among the tenants that want some (requests in flight, or one admitted lately). Such a
        request does not queue behind others that hold more: it may take a replica up to twice
        its cap."""
        cfg = self.config
        if req.priority >= cfg.batch_priority:
            return False
        return self._share(req.tenant, slots) is True

    def over_share(self, tenant: str, model: str | None) -> bool:
        """Whether `tenant` holds more than its weighted share of the model's slots while another
        tenant also wants some (see _within_share)."""
        now = time.monotonic()
        n = sum(
            r.model == model and r.role in SERVING_ROLES and r.routable(now) for r in self.replicas.values()
        )
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

    def spare_slots(self, model: str | None) -> int:
        """Free request slots on the model's ready serving replicas, less the requests waiting here."""
        now = time.monotonic()
        cap = self.config.max_inflight_per_replica
        free = sum(
            max(0, cap - r.inflight)
            for r in self.replicas.values()
            if r.model == model and r.role in SERVING_ROLES and r.routable(now)
        )
        return free - self.fair.waiting(model)

    def _canary_split(self, model: str | None, free: list[Replica]) -> list[Replica]:
        """Under a canary, the canary's share of requests goes to the new version, the rest to the old."""
        if model not in self.canary:
            return free
        version, share = self.canary[model]
        new = [r for r in free if r.version == version]
        old = [r for r in free if r.version != version]
        if not new or not old:
            return free
        return new if random.random() < share else old

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

    async def release(self, r: Replica, ok: bool | None, reason: str = "", failed: bool = False) -> None:
        """Ends a request on `r`: ok counts for it, False against it (the circuit breaker), None
        neither (a timeout on a replica that still passes probes). `failed`: the request failed
        there all the same (a 503, a 500 of its own, a timeout), which a rolling update counts."""
        self._account(r, ok, reason, failed)
        self.wake()

    def release_nowait(self, r: Replica, ok: bool | None, reason: str = "", failed: bool = False) -> None:
        """`release` for cleanup that must not await (a cancelled stream's, which anyio would
        cancel again at each await)."""
        self._account(r, ok, reason, failed)
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
            slots = sum(
                max(0, cap - r.inflight)
                for r in self.replicas.values()
                if r.model == model and r.routable(now)
            )
            for w in self.fair.to_wake(model, slots):
                w.wake.set()

    def notify_nowait(self) -> None:
        """Wakes requests waiting for a replica (one was promoted, or became free)."""
        self.wake(everyone=True)

    def _account(self, r: Replica, ok: bool | None, reason: str, failed: bool) -> None:
        r.inflight -= 1
        r.failed_total += int(failed or ok is False)
        self.metrics.inflight.labels(r.name).set(r.inflight)
        if ok:
            r.on_success()
        elif ok is None:
            r.trial_inflight = False
        elif r.on_failure(reason, self.config.eject_after_errors, self.config.eject_for_s):
            self.metrics.ejections.labels(r.name).inc()
            log.warning("replica %s ejected after: %s", r.name, reason)
