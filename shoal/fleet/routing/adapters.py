"""LoRA adapters across the fleet: which replicas hold which adapter, which of them a request for
an adapter may go to, and loading an adapter on another replica when none holds it or those that
do are busy.

A replica says what it holds in its /load answer (`lora`: adapters registered, with their
folders; those resident in its slots; its number of slots). The gateway learns each adapter's
folder from there or from its own load route, so it can load the adapter on any replica that
reads the same path (one host, or a shared file system). Routing keeps an adapter's requests on
the replicas that hold it, resident first, so that slots are not cycled replica after replica
(S-LoRA's and Punica's point: adapter affinity at the cluster level), and spreads it to one more
replica only when every holder is busy."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.replicas.replica import Replica
from shoal.fleet.replicas.table import ReplicaTable
from shoal.protocol.errors import APIError

log = logging.getLogger(__name__)

RETRY_LOAD_AFTER_S = 10.0  # after an adapter failed to load on a replica, before trying again


def lora_report(r: Replica) -> dict | None:
    """The replica's last word on its adapters (None: it serves none, or has not said yet)."""
    report = r.load.get("lora")
    return report if isinstance(report, dict) else None


def holds(r: Replica, adapter: str) -> bool:
    report = lora_report(r)
    return report is not None and adapter in (report.get("adapters") or {})


def resident(r: Replica, adapter: str) -> bool:
    report = lora_report(r)
    return report is not None and adapter in (report.get("resident") or ())


@dataclass
class AdapterEntry:
    path: str  # the adapter's folder, as the replicas read it
    model: str | None  # the base model it was trained on, as the fleet names it (None: the only one)


class AdapterDirectory:
    def __init__(
        self,
        table: ReplicaTable,
        http: httpx.AsyncClient,
        metrics: GatewayMetrics,
        busy_at: int,
        on_loaded: Callable[[], None],
    ):
        self.table = table
        self.http = http  # it sends the replicas' key
        self.metrics = metrics
        self.busy_at = busy_at  # outstanding requests from which a holder counts as busy
        self.on_loaded = on_loaded  # requests waiting for a holder look again
        self.entries: dict[str, AdapterEntry] = {}
        self.withdrawn: set[str] = set()  # being unloaded fleet-wide: not routed to
        self._loading: dict[str, asyncio.Task] = {}  # adapter -> its load on one more replica
        self._learned_at = -1.0
        self.failed: dict[str, tuple[float, str]] = {}  # adapter -> (when, why) its last load failed

    # --- what the fleet serves ---------------------------------------------------------------

    def learn(self, every_s: float = 0.0) -> None:
        """Adapters the replicas report that the directory does not know yet (not again within
        `every_s` of the last look: reports change at the /load poll's pace)."""
        now = time.monotonic()
        if now - self._learned_at < every_s:
            return
        self._learned_at = now
        for r in self.table.replicas.values():
            report = lora_report(r)
            for name, path in ((report or {}).get("adapters") or {}).items():
                if name not in self.entries and name not in self.withdrawn and isinstance(path, str):
                    self.entries[name] = AdapterEntry(path, r.model)

    def lookup(self, name) -> AdapterEntry | None:
        """The adapter a request's `model` names, or None when it names none the fleet serves."""
        if not isinstance(name, str) or name in self.withdrawn:
            return None
        if name not in self.entries:
            self.learn(every_s=0.1)  # most requests name the base model: not a scan each
        return self.entries.get(name)

    # --- where its requests go -----------------------------------------------------------

    def busy(self, r: Replica) -> bool:
        return r.outstanding >= self.busy_at

    def narrow(self, candidates: list[Replica], adapter: str) -> list[Replica]:
        """The candidates a request for `adapter` may go to: those holding it where it is resident
        and not busy, else those holding it and not busy, else every holder (the request waits
        its turn there). When every holder is busy and a replica that could take the adapter is
        not, the adapter is loaded there in the background."""
        holders = [r for r in candidates if holds(r, adapter)]
        idle = [r for r in holders if not self.busy(r)]
        warm = [r for r in idle if resident(r, adapter)]
        if not idle:
            spare = [r for r in candidates if lora_report(r) is not None and not holds(r, adapter)]
            if holders:  # spread only to a replica that has room for it
                spare = [r for r in spare if not self.busy(r)]
            if spare:
                self.spread(
                    adapter, min(spare, key=lambda r: r.outstanding), "busy" if holders else "none_held"
                )
        return warm or idle or holders

    def loading(self, adapter: str) -> bool:
        task = self._loading.get(adapter)
        return task is not None and not task.done()

    def spread(self, adapter: str, to: Replica, reason: str) -> asyncio.Task | None:
        """Loads `adapter` on `to` in the background (one such load per adapter at a time, and
        none for a while after one failed)."""
        task = self._loading.get(adapter)
        if task is not None and not task.done():
            return task
        failed = self.failed.get(adapter)
        if failed is not None and time.monotonic() - failed[0] < RETRY_LOAD_AFTER_S:
            return None
        task = asyncio.get_running_loop().create_task(self._load_on(adapter, to, reason))
        self._loading[adapter] = task
        return task

    async def ensure_holder(self, adapter: str, model: str | None) -> None:
        """Before a request for `adapter` is dispatched: when no serving replica of `model` holds
        it, loads it on the least loaded one that takes adapters (the request waits for that, not a
        404)."""
        candidates = self.table.serving(model, time.monotonic())
        if any(holds(r, adapter) for r in candidates):
            return
        able = [r for r in candidates if lora_report(r) is not None]
        if not able:
            return  # none is up yet, or none takes adapters: dispatch waits or fails as for any model
        task = self.spread(adapter, min(able, key=lambda r: r.outstanding), "none_held")
        if task is not None:
            await asyncio.shield(task)
        if not any(holds(r, adapter) for r in self.table.serving(model, time.monotonic())):
            why = self.failed.get(adapter, (0, "no replica could load it"))[1]
            raise APIError(503, f"the adapter {adapter!r} is not loaded on any replica: {why}", "model")

    async def _load_on(self, adapter: str, r: Replica, reason: str) -> bool:
        entry = self.entries.get(adapter)
        if entry is None:
            return False
        t0 = time.monotonic()
        try:
            resp = await self.http.post(
                r.url + "/v1/load_lora_adapter",
                json={"lora_name": adapter, "lora_path": entry.path},
                timeout=60,
            )
        except httpx.HTTPError as exc:
            return self._load_failed(adapter, r, f"{type(exc).__name__}: {exc}")
        ok = resp.status_code == 200 or (resp.status_code == 400 and "already served" in resp.text)
        if not ok:
            return self._load_failed(adapter, r, f"{resp.status_code} {resp.text[:300]}")
        self.failed.pop(adapter, None)
        report = lora_report(r)
        if report is not None:  # until its next /load answer says so itself
            report.setdefault("adapters", {})[adapter] = entry.path
        self.metrics.adapter_loads.labels(adapter, reason).inc()
        log.info(
            "adapter %s loaded on %s (%s) in %.0f ms", adapter, r.name, reason, 1000 * (time.monotonic() - t0)
        )
        self.on_loaded()
        return True

    def _load_failed(self, adapter: str, r: Replica, why: str) -> bool:
        log.warning("loading adapter %s on %s failed: %s", adapter, r.name, why)
        self.failed[adapter] = (time.monotonic(), f"{r.name} answered {why}")
        return False

    # --- the fleet-wide load and unload routes ------------------------------------------------

    async def load(self, name: str, path: str, model: str | None) -> list[str]:
        """Serves a new adapter over `model`: known fleet-wide from now on and loaded on one
        replica (others load it when its traffic needs them). Returns the replicas that hold it."""
        candidates = self.table.serving(model, time.monotonic())
        if not any(lora_report(r) is not None for r in candidates):
            raise APIError(
                400, "no ready replica takes LoRA adapters (start them with --enable-lora)", "lora_name"
            )
        self.withdrawn.discard(name)
        previous = self.entries.get(name)
        self.entries[name] = AdapterEntry(path, model)
        able = [r for r in candidates if lora_report(r) is not None]
        target = min(able, key=lambda r: r.outstanding)
        if not await self._load_on(name, target, "load_route"):
            if previous is None:
                del self.entries[name]
            else:
                self.entries[name] = previous
            why = self.failed.get(name, (0, "it did not say why"))[1]
            raise APIError(400, f"could not load {path!r}: {why}", "lora_path")
        return [r.name for r in self.table.replicas.values() if holds(r, name)]

    async def unload(self, name: str, drain_s: float) -> list[str]:
        """Stops routing to `name`, then unloads it from every replica holding it, waiting up to
        `drain_s` for the requests using it to end. Returns the replicas it left."""
        if self.lookup(name) is None:
            raise APIError(404, f"no adapter {name!r} is served", "lora_name", "model_not_found")
        self.withdrawn.add(name)
        deadline = time.monotonic() + drain_s
        left, busy = [], []
        while True:
            busy = []
            for r in [r for r in self.table.replicas.values() if holds(r, name)]:
                status = await self._unload_on(name, r)
                if status == 409:
                    busy.append(r.name)
                elif status in (200, 404):
                    left.append(r.name)
            if not busy or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.2)
        if busy:
            self.withdrawn.discard(name)  # still served where it is in use: routable again
            raise APIError(
                409, f"adapter {name!r} is still in use on {', '.join(busy)}", "lora_name", "adapter_in_use"
            )
        self.entries.pop(name, None)
        return left

    async def _unload_on(self, name: str, r: Replica) -> int | None:
        try:
            resp = await self.http.post(
                r.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30
            )
        except httpx.HTTPError:
            return None
        if resp.status_code in (200, 404):
            report = lora_report(r)
            if report is not None:
                (report.get("adapters") or {}).pop(name, None)
        return resp.status_code
