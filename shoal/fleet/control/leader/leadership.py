"""One gateway of several leads: it holds the lease, runs the controller and the batch lane, and
publishes the replica set; the others follow that replica set (they route to every replica and
probe each themselves) and try for the lease, so that one of them leads within a lease's time of
the leader's death, adopting the replicas that still run. The last gateway to stop gracefully
stops the replicas; when the last one dies, the replicas' lifeline ends them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from shoal.fleet.admission.store import store_errors
from shoal.fleet.config import GatewayConfig
from shoal.fleet.control.controller import FleetController
from shoal.fleet.control.leader.lease import Lease
from shoal.fleet.control.leader.registry import FleetRegistry
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.replicas.replica import Lifecycle
from shoal.fleet.replicas.table import ReplicaTable

log = logging.getLogger(__name__)


class Lane(Protocol):
    """What runs on the leader only (the batch lane)."""

    async def lead(self) -> None: ...

    async def follow(self) -> None: ...


class Leadership:
    def __init__(
        self,
        config: GatewayConfig,
        store,
        controller: FleetController,
        table: ReplicaTable,
        lane: Lane,
        metrics: GatewayMetrics,
        notify: Callable[[], None],
    ):
        self.config = config
        self.id = f"http://{config.host}:{config.port}"  # how the others name (and reach) it
        self.registry = FleetRegistry(store, f"{config.store_prefix}fleet:")
        self.lease = Lease(store, self.registry.lease_key, self.id, config.lease_ttl_s)
        self.controller = controller
        self.table = table
        self.lane = lane
        self.metrics = metrics
        self.notify = notify  # replicas came or went: requests waiting for one look again
        self.errors = store_errors()
        self.leading = False
        self.leader: str | None = None
        self.gateways = 0
        self.since = time.monotonic()  # of this gateway's current role
        self.renewed_at = 0.0
        self.followed: set[str] = set()  # replicas in the table from the leader's state
        self.state: dict = {}  # the leader's, as last read (a follower's view of the pools)
        self._task: asyncio.Task | None = None

    @property
    def interval(self) -> float:
        return self.config.lease_ttl_s / 3

    async def start(self) -> None:
        """Joins the fleet: takes its secrets, and leads at once when no gateway does."""
        gw = self.config
        gw.kv_salt, gw.kv_transfer_key = await self.registry.secrets(gw.kv_salt, gw.kv_transfer_key)
        self.gateways = await self.registry.gateways.beat(self.id, self.config.lease_ttl_s)
        await self._try_lead()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._step()
            except self.errors as exc:
                log.warning("fleet store: %s", exc)
                if self.leading and time.monotonic() - self.renewed_at > self.config.lease_ttl_s:
                    await self._step_down("its lease ran out while the store could not be reached")
            except Exception:  # the loop that keeps the fleet led must outlive any one step
                log.exception("leadership step failed; retrying")

    async def _step(self) -> None:
        self.gateways = await self.registry.gateways.beat(self.id, self.config.lease_ttl_s)
        self.metrics.gateways_alive.set(self.gateways)
        if not self.leading:
            return await self._try_lead()
        if not await self.lease.renew():
            return await self._step_down("another gateway holds the lease")
        self.renewed_at = time.monotonic()
        await self.registry.publish(self.id, self.controller.published())

    async def _try_lead(self) -> None:
        if not await self.lease.acquire():
            self.leader = await self.lease.holder_now()
            state = await self.registry.state()
            if state:
                self._follow(state)
            return
        self.renewed_at = time.monotonic()
        state = await self.registry.state()
        self.leading, self.leader, self.since = True, self.id, time.monotonic()
        self.metrics.leading.set(1)
        self.followed.clear()  # the controller's own from now
        adopted = await self.controller.start(state)
        await self.lane.lead()
        await self.registry.publish(self.id, self.controller.published())
        took = len((state or {}).get("replicas", []))
        if took:
            log.warning("this gateway leads the fleet now (%d of %d replicas adopted)", adopted, took)
        else:
            log.warning("this gateway leads the fleet: it starts the replicas")

    async def _step_down(self, why: str) -> None:
        log.warning("this gateway no longer leads the fleet: %s", why)
        self.leading, self.since = False, time.monotonic()
        self.metrics.leading.set(0)
        await self.controller.detach()
        await self.lane.follow()
        # What the controller ran is in the table still: followed from now, until the leader's
        # state says otherwise.
        self.followed = {s.name for s in self.controller.slots}

    def _follow(self, state: dict) -> None:
        """The table in step with the leader's replica set."""
        self.state = state
        names, changed = set(), False
        for r in state.get("replicas", []):
            name = r["name"]
            names.add(name)
            rep = self.table.replicas.get(name)
            if rep is None or rep.url != r["url"]:
                rep = self.table.add(name, r["url"])  # new, or restarted elsewhere: probes say when ready
                changed = True
            rep.role, rep.model, rep.version, rep.restarts = (
                r["role"],
                r["served"],
                r["version"],
                r["restarts"],
            )
            lifecycle = Lifecycle(r["state"])
            changed |= rep.lifecycle != lifecycle
            rep.lifecycle = lifecycle
        for gone in self.followed - names:
            self.table.remove(gone)
            changed = True
        self.followed = names
        if changed:
            self.notify()

    def snapshot(self) -> dict:
        """Who leads, for /fleet/leader and the status page."""
        return {
            "gateway": self.id,
            "leading": self.leading,
            "leader": self.leader,
            "gateways": self.gateways,
            "role_for_s": round(time.monotonic() - self.since, 1),
        }

    def pools(self) -> list[dict]:
        """The fleet's pools: the controller's own while leading, else as the leader published."""
        return self.controller.snapshot() if self.leading else self.state.get("snapshot", [])

    async def stop(self) -> None:
        """Leaves the fleet. The leader hands the replicas to the gateways still alive (one leads
        within its next step), or stops them when it is the last."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            others = await self.registry.gateways.leave(self.id)
        except self.errors as exc:
            log.warning("fleet store: %s; the replicas are left to their lifeline", exc)
            if self.leading:
                await self.controller.detach()
            return
        if not self.leading:
            return
        if others:
            await self.controller.detach()
            await self.lease.release()
            log.warning("left the fleet to the %d other gateways", others)
        else:
            await self.controller.stop()
            await self.registry.clear()
            await self.lease.release()
