"""The replica registry: health probes, load and KV-event polling, admission to replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from shoal.fleet.config import GatewayConfig
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.policies import Policy, RouteRequest
from shoal.fleet.prefix_index import PrefixIndex
from shoal.fleet.replica import Replica, ReplicaState

log = logging.getLogger(__name__)


class NoReplicaError(Exception):
    """No replica can take the request now (none ready, or all full past the queue bound)."""


class Registry:
    def __init__(self, config: GatewayConfig, policy: Policy, index: PrefixIndex, metrics: GatewayMetrics):
        self.config = config
        self.policy = policy
        self.index = index
        self.metrics = metrics
        self.replicas: dict[str, Replica] = {}
        self._changed = asyncio.Condition()
        self._waiters = 0
        self._tasks: list[asyncio.Task] = []
        self.client: httpx.AsyncClient | None = None

    def add(self, name: str, url: str, pid: int | None = None) -> Replica:
        r = self.replicas.get(name)
        if r is None:
            r = self.replicas[name] = Replica(name, url.rstrip("/"))
        r.pid = pid
        return r

    def mark_down(self, name: str, reason: str) -> None:
        r = self.replicas[name]
        r.state = ReplicaState.DOWN
        r.recent_errors.append((time.time(), reason))
        self.index.reset(name)

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
            for r in replicas:
                self.metrics.replica_up.labels(r.name).set(1 if r.state == ReplicaState.READY else 0)
            await asyncio.sleep(interval)

    async def _probe(self, r: Replica) -> None:
        """Active checks: /health says alive, /ready says loaded. The circuit breaker is left to
        passive checks, since a replica can pass probes and still fail requests."""
        try:
            health = await self.client.get(r.url + "/health", timeout=1.0)
            ready = (
                await self.client.get(r.url + "/ready", timeout=1.0) if health.status_code == 200 else None
            )
        except httpx.HTTPError as exc:
            if r.state != ReplicaState.DOWN:
                self.mark_down(r.name, f"probe: {type(exc).__name__}")
            return
        if health.status_code != 200:
            if r.state != ReplicaState.DOWN:
                self.mark_down(r.name, f"probe: /health {health.status_code}")
            return
        is_ready = ready is not None and ready.status_code in (200, 404)  # 404: a server without /ready
        if r.state in (ReplicaState.DOWN, ReplicaState.LOADING):
            r.state = ReplicaState.READY if is_ready else ReplicaState.LOADING
            if is_ready:
                r.consecutive_failures = 0
                async with self._changed:
                    self._changed.notify_all()
        elif not is_ready and r.state == ReplicaState.READY:
            r.state = ReplicaState.LOADING

    async def _poll_load(self, r: Replica) -> None:
        if r.state == ReplicaState.DOWN or r.load.get("unsupported"):
            return
        try:
            resp = await self.client.get(r.url + "/load", timeout=1.0)
        except httpx.HTTPError:
            return
        if resp.status_code == 404:
            r.load = {"unsupported": True}
        elif resp.status_code == 200:
            r.load = resp.json()

    async def _poll_kv(self, r: Replica) -> None:
        if r.state == ReplicaState.DOWN:
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

    async def acquire(self, req: RouteRequest, exclude: set[str]) -> Replica:
        """A replica for the request, waiting in the bounded queue while all are at their cap."""
        cfg = self.config
        deadline = time.monotonic() + cfg.queue_timeout_s
        queued = False
        try:
            async with self._changed:
                while True:
                    now = time.monotonic()
                    routable = [
                        r for r in self.replicas.values() if r.name not in exclude and r.routable(now)
                    ]
                    if not routable:
                        raise NoReplicaError("no replica is ready")
                    free = [r for r in routable if r.inflight < cfg.max_inflight_per_replica]
                    if free:
                        replica, reason = self.policy.choose(free, req)
                        replica.on_dispatch()
                        self.metrics.decisions.labels(self.policy.name, reason).inc()
                        self.metrics.requests.labels(replica.name).inc()
                        self.metrics.inflight.labels(replica.name).set(replica.inflight)
                        if req.hashes:
                            self.index.routed(replica.name, req.hashes)
                        return replica
                    if not queued:
                        if self._waiters >= cfg.max_queue:
                            raise NoReplicaError(
                                "every replica is at its concurrency cap and the queue is full"
                            )
                        queued = True
                        self._waiters += 1
                    remaining = deadline - now
                    if remaining <= 0:
                        raise NoReplicaError("timed out waiting for a free replica")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), min(remaining, 0.5))
        finally:
            if queued:
                self._waiters -= 1

    async def release(self, r: Replica, ok: bool, reason: str = "") -> None:
        r.inflight -= 1
        self.metrics.inflight.labels(r.name).set(r.inflight)
        if ok:
            r.on_success()
        elif r.on_failure(reason, self.config.eject_after_errors, self.config.eject_for_s):
            self.metrics.ejections.labels(r.name).inc()
            log.warning("replica %s ejected after: %s", r.name, reason)
        async with self._changed:
            self._changed.notify_all()
