"""Health probing: active checks of every replica in the table (/health, /ready), its load (/load)
and its KV events (/kv_events, into the prefix index), and the verdict on a replica after one of
its connections dropped. The circuit breaker is left to passive checks (admission's release),
since a replica can pass probes and still fail requests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

from shoal.fleet.config import GatewayConfig
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.replica import Death, Health, Replica
from shoal.fleet.replicas.table import ReplicaTable
from shoal.protocol.supervision import GATEWAY_HEADER

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        config: GatewayConfig,
        table: ReplicaTable,
        index: PrefixIndex,
        metrics: GatewayMetrics,
        on_ready: Callable[[], None],
        on_return: Callable[[Death], None] | None = None,
    ):
        self.config = config
        self.table = table
        self.index = index
        self.metrics = metrics
        self.on_ready = on_ready  # a replica came (back): requests waiting for one look again
        # A replica that was unreachable came back as the same process (a partition): not a death.
        self.on_return = on_return
        self.client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        key = self.config.replica_key
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(2.0),
            limits=httpx.Limits(max_connections=64),
            # The probes are the replicas' sign that a gateway still wants them (their lifeline).
            headers={GATEWAY_HEADER: "probe", **({"authorization": f"Bearer {key}"} if key else {})},
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
            self.table.mark_down(r.name, "a request's connection dropped and /health failed")
        if r.proc_exit is not None and r.death.exit_code is None:
            deadline = time.monotonic() + exit_wait_s
            while (code := r.proc_exit()) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if code is not None:
                r.death.exit_code = code
        return r.death

    # --- background loops ----------------------------------------------------------------

    async def _every(self, interval: float, fn) -> None:
        while True:
            replicas = list(self.table.replicas.values())
            await asyncio.gather(*(fn(r) for r in replicas), return_exceptions=True)
            waiting: dict[str, float] = {}
            for r in replicas:
                up = r.state == Health.READY
                self.metrics.replica_up.labels(r.name).set(1 if up else 0)
                waiting[r.role] = waiting.get(r.role, 0) + (r.load.get("waiting", 0) if up else 0)
            for role, n in waiting.items():
                self.metrics.role_waiting.labels(role).set(n)
            await asyncio.sleep(interval)

    async def _probe(self, r: Replica) -> None:
        """Active checks: /health says alive, /ready says loaded.

        A replica the fleet started is only ever probed while its own process runs: after a crash
        of the supervisor, an orphan of the old fleet may still answer on the port, and what
        answers there is not ours to route to."""
        mark_down = self.table.mark_down
        if r.state == Health.PORT_IN_USE:
            return
        if not r.process_alive:
            if r.state != Health.DOWN:
                mark_down(r.name, f"process exited with {r.proc_exit()}", r.proc_exit())
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
            # Frozen (SIGSTOP, a stuck event loop), slow, or cut off: down after a few misses in
            # a row. Only a connect that times out says it is unreachable: a frozen process's
            # kernel still accepts connections.
            r.probe_misses += 1
            if r.probe_misses >= self.config.probe_misses and r.state != Health.DOWN:
                mark_down(r.name, f"probe: {type(exc).__name__} {r.probe_misses} times")
                r.death.unreachable = isinstance(exc, httpx.ConnectTimeout)
            return
        except httpx.HTTPError as exc:  # refused or reset: nothing serves there now
            if r.state == Health.LOADING and r.proc_exit is not None:
                return  # our process, still starting
            if r.state != Health.DOWN:
                mark_down(r.name, f"probe: {type(exc).__name__}")
            return
        r.probe_misses = 0
        if not r.process_alive:
            return  # it exited while the probe ran: whatever answered is not ours
        if health.status_code != 200:
            if r.state == Health.LOADING:
                r.note = f"/health {health.status_code}: {health.text[:200]}"  # e.g. the model failed to load
            elif r.state != Health.DOWN:
                mark_down(r.name, f"probe: /health {health.status_code}")
            return
        is_ready = ready is not None and ready.status_code in (200, 404)  # 404: a server without /ready
        instance = _instance(ready)
        if _draining(ready):
            self.table.saw_draining(r.name)
        elif r.state in (Health.DOWN, Health.LOADING, Health.DRAINING):
            r.state = Health.READY if is_ready else Health.LOADING
            if is_ready:
                death = r.death
                if (
                    death is not None
                    and death.unreachable
                    and instance is not None
                    and instance == death.instance
                ):
                    log.info("%s is back as the same process: it was cut off, not dead", r.name)
                    if self.on_return is not None:
                        self.on_return(death)
                r.begin_life()
                self.on_ready()
        elif not is_ready and r.state == Health.READY:
            r.state = Health.LOADING
        if instance is not None:
            r.instance = instance

    async def _poll_load(self, r: Replica) -> None:
        if r.state in (Health.DOWN, Health.PORT_IN_USE) or r.load.get("unsupported"):
            return
        try:
            resp = await self.client.get(r.url + "/load", timeout=1.0)
        except httpx.HTTPError:
            return
        if not r.process_alive:
            return  # whatever answered is not ours (as in _probe)
        if resp.status_code == 404:
            r.load = {"unsupported": True}
        elif resp.status_code == 200:
            r.load = resp.json()
            role = r.load.get("role")
            if isinstance(role, str):
                r.role = role
            lora = r.load.get("lora")
            if isinstance(lora, dict):
                for state, key in (("registered", "adapters"), ("resident", "resident")):
                    self.metrics.replica_adapters.labels(r.name, state).set(len(lora.get(key) or ()))

    async def _poll_kv(self, r: Replica) -> None:
        if r.state in (Health.DOWN, Health.PORT_IN_USE):
            return
        try:
            resp = await self.client.get(r.url + "/kv_events", params={"after": r.kv_cursor}, timeout=1.0)
        except httpx.HTTPError:
            return
        if not r.process_alive:
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


def _draining(ready: httpx.Response | None) -> bool:
    """Whether a shoal replica's /ready says it shuts down."""
    if ready is None or ready.status_code != 503:
        return False
    try:
        return ready.json().get("draining") is True
    except (ValueError, AttributeError):
        return False


def _instance(ready: httpx.Response | None) -> str | None:
    """The process identity a shoal replica's /ready names (None from other servers)."""
    if ready is None or ready.status_code != 200:
        return None
    try:
        found = ready.json().get("instance")
    except ValueError:
        return None
    return found if isinstance(found, str) else None
