"""The fleet controller: a reconcile loop that moves each model's actual replicas toward the desired
ones through a launcher. It restarts replicas that die (with exponential backoff), asks each
pool's autoscaler how many should take traffic, promotes warm standbys at once when more are
needed and refills the standby pool behind them, and drains replicas it no longer needs: they
take no new request, finish what they run, then stop (or stay loaded as standbys)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable

from shoal.fleet.admission.canary import CanarySplit
from shoal.fleet.admission.signals import DemandSignals
from shoal.fleet.config import FleetConfig
from shoal.fleet.control.autoscaler import Autoscaler, Signals
from shoal.fleet.control.history import FleetHistory
from shoal.fleet.control.launchers.base import Launcher
from shoal.fleet.control.placement import Placement
from shoal.fleet.control.replica_set import Lifecycle, Pool, ReplicaSet, Slot
from shoal.fleet.control.rollout import RolloutDriver
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.proxy.shadow import Shadow
from shoal.fleet.replicas.replica import Health
from shoal.fleet.replicas.table import ReplicaTable
from shoal.protocol.secrets import KV_SALT_ENV

log = logging.getLogger(__name__)

TICK_S = 0.1
TTFT_WINDOW_S = 30.0


class FleetController:
    def __init__(
        self,
        config: FleetConfig,
        launcher: Launcher,
        table: ReplicaTable,
        demand: DemandSignals,
        canary: CanarySplit,
        shadow: Shadow,
        metrics: GatewayMetrics,
        notify: Callable[[], None],
    ):
        self.config = config
        gw = config.gateway
        # One salt per fleet, shared by its replicas (through the environment: argv is public) and
        # its gateway, so that the router's block hashes are the replicas' own; likewise the key
        # of K/V handoffs between its workers.
        if not gw.kv_salt:
            gw.kv_salt = os.environ.get(KV_SALT_ENV) or secrets.token_hex(16)
        if not gw.kv_transfer_key:
            gw.kv_transfer_key = secrets.token_hex(16)
        self.log_dir = tempfile.mkdtemp(prefix="shoal-fleet-")
        self.models = config.model_configs()
        self.multi_model = bool(config.models)
        self.table = table
        self.demand = demand
        self.metrics = metrics
        self.replica_set = ReplicaSet(config, launcher, table, metrics, notify, self.log_dir)
        self.rollouts = RolloutDriver(
            self.replica_set, table, canary, shadow, metrics, config.update_ready_timeout_s, config.canary
        )
        self.placement = Placement(self.replica_set, table, demand, metrics, config.memory_budget_mb)
        self.history = FleetHistory()
        self._task: asyncio.Task | None = None
        self.started = time.monotonic()
        for m in self.models:
            for role, lo, hi in m.pools():
                # Disaggregated pools are fixed; so is a pool whose bounds leave nothing to decide.
                scaler = Autoscaler(m.autoscale, lo, hi, m.scale_to_zero_after_s) if m.autoscaled else None
                pool = Pool(m, role, lo, hi, scaler, desired=lo)
                self.replica_set.pools.append(pool)
                for _ in range(lo + pool.warm):
                    self.replica_set.new_slot(pool)

    @property
    def pools(self) -> list[Pool]:
        return self.replica_set.pools

    @property
    def slots(self) -> list[Slot]:
        return self.replica_set.slots

    def busy_ports(self) -> list[int]:
        return self.replica_set.busy_ports()

    # --- reconcile -----------------------------------------------------------------------

    def signals(self, pool: Pool, now: float) -> Signals:
        reps = self.table.replicas
        active = [reps[s.name] for s in pool.in_state(Lifecycle.READY) if s.name in reps]
        key = pool.model.name
        ttft = self.demand.ttft_p90(key, now - TTFT_WINDOW_S)
        return Signals(
            active=len(active),
            inflight=sum(r.inflight for r in active),
            queued=self.demand.queued.get(key, 0),
            waiting=sum(r.load.get("waiting", 0) for r in active),
            kv_usage=sum(r.load.get("kv_usage", 0.0) for r in active) / max(1, len(active)),
            ttft_p90=ttft,
            idle_s=now - self.demand.last_request.get(key, self.started),
            desired=pool.desired,
        )

    def reconcile(self, pool: Pool, now: float) -> None:
        reps, demand, rs = self.table.replicas, self.demand, self.replica_set
        if pool.rollout is not None:
            self.rollouts.step(pool, now)
        key = pool.model.name
        if pool.evicted_at is not None and (
            demand.queued.get(key) or demand.last_request.get(key, 0) > pool.evicted_at
        ):
            pool.evicted_at = None  # asked for again
        if pool.evicted_at is not None:
            pool.desired, pool.decision = 0, "unloaded for memory"
        elif pool.autoscaler is not None:
            d = pool.autoscaler.decide(self.signals(pool, now), now)
            if d.changed and d.desired != pool.desired:
                direction = "up" if d.desired > pool.desired else "down"
                if direction == "up":
                    pool.raised_at = now
                log.warning(
                    "autoscaler %s: %d -> %d active replicas (%s)",
                    pool.key,
                    pool.desired,
                    d.desired,
                    d.reason,
                )
                self.metrics.autoscaler_decisions.labels(pool.key, direction, d.signal).inc()
                self.history.decision(pool.key, pool.desired, d.desired, d.reason)
            pool.desired, pool.decision = d.desired, d.reason
        loaded = [
            s
            for s in pool.in_state(Lifecycle.STARTING)
            if s.name in reps and reps[s.name].state == Health.READY
        ]
        active = pool.in_state(Lifecycle.READY)
        for s in loaded:
            if len(active) < pool.desired:
                rs.set_state(s, Lifecycle.READY, "loaded, needed")
                active.append(s)
            else:
                rs.set_state(s, Lifecycle.STANDBY, "loaded, kept warm")
        standby = pool.in_state(Lifecycle.STANDBY)
        while len(active) < pool.desired and standby:
            s = standby.pop()
            rs.set_state(s, Lifecycle.READY, "promoted")
            active.append(s)
        for s in pool.in_state(Lifecycle.DRAINING):
            self._drain_step(s, now, len(standby) < pool.warm and s.version == pool.version)
        # Spares: what is starting or standing by, beyond the active replicas still missing (a
        # rolling update's surge replica is the update's own).
        spares = [s for s in pool.in_state(Lifecycle.STARTING, Lifecycle.STANDBY) if not s.surge]
        want = max(0, pool.desired - len(active)) + pool.warm
        for _ in range(want - len(spares)):
            if not rs.launcher.has_room():
                break  # no free cores (cores.when_full = "wait"): started once a replica's are free
            if not self.placement.fits(pool):
                self.placement.make_room(pool, now)
                break  # placed once the memory is free
            rs.start_slot(rs.new_slot(pool), now)
        old_first = sorted(spares, key=lambda s: (s.version == pool.version, s.state == Lifecycle.STANDBY))
        for s in old_first[: max(0, len(spares) - want)]:
            rs.stop_slot(s, "not needed")
        if len(active) > pool.desired:
            by_load = sorted(active, key=lambda s: reps[s.name].inflight if s.name in reps else 0)
            for s in by_load[: len(active) - pool.desired]:
                rs.set_state(s, Lifecycle.DRAINING, pool.decision or "scale-down")
        self.metrics.desired.labels(pool.key).set(pool.desired)
        for state in Lifecycle:
            self.metrics.lifecycle.labels(pool.key, state.value).set(len(pool.in_state(state)))

    def _drain_step(self, slot: Slot, now: float, keep_warm: bool) -> None:
        rs = self.replica_set
        rep = self.table.replicas.get(slot.name)
        busy = rep is not None and rep.inflight > 0
        if busy and now - slot.drain_since < self.config.drain_timeout_s:
            return
        if keep_warm and rep is not None and rep.state == Health.READY:
            rs.set_state(slot, Lifecycle.STANDBY, "drained, kept warm")
        else:
            rs.stop_slot(slot, "drained" if not busy else "drain timed out")

    def update(
        self,
        model: str | None,
        changes: dict,
        canary: float = 0.0,
        canary_s: float = 30.0,
        shadow: float | None = None,
    ) -> list[str]:
        """Starts a rolling update of `model`'s pools to its config with `changes` (model,
        replica_args); returns the pools it updates. ValueError: nothing to update, or one is on."""
        pools = [p for p in self.pools if not self.multi_model or p.model.name == model]
        if not pools:
            raise ValueError(f"this fleet has no model {model!r}")
        busy = [p.key for p in pools if p.rollout is not None]
        if busy:
            raise ValueError(f"a rolling update of {', '.join(busy)} is still in progress")
        unknown = set(changes) - {"model", "replica_args"}
        if unknown:
            raise ValueError(
                f"a rolling update changes model and replica_args, not {', '.join(sorted(unknown))}"
            )
        now = time.monotonic()
        for p in pools:
            self.rollouts.begin(p, dataclasses.replace(p.model, **changes), canary, canary_s, now, shadow)
        return [p.key for p in pools]

    def snapshot(self) -> list[dict]:
        """Each pool's bounds, desired count, last decision and replicas by state."""
        return [
            {
                "pool": p.key,
                "model": p.model.name,
                "role": p.role,
                "min": p.min,
                "max": p.max,
                "warm_standby": p.warm,
                "desired": p.desired,
                "decision": p.decision,
                "version": p.version,
                "updating": p.rollout is not None,
                "last_update": p.last_rollout,
                "judgement": p.rollout.judgement if p.rollout is not None else p.last_judgement,
                "memory_mb": p.model.memory_mb,
                "unloaded": p.evicted_at is not None,
                "replicas": {s.name: s.state.value for s in p.slots},
                "versions": {s.name: s.version for s in p.slots},
                "cores": {s.name: getattr(s.proc, "cpus", None) for s in p.slots},
            }
            for p in self.pools
        ]

    # --- the loop ------------------------------------------------------------------------

    async def start(self, taken_over: dict | None = None) -> int:
        """Called on the event loop's thread, which spawns every replica (see launchers); with
        `taken_over` (a fleet's published state: see leader/), those of the earlier leader that
        still run are adopted instead. Returns how many were."""
        adopted = 0
        if taken_over:
            adopted = self.replica_set.adopt(taken_over.get("replicas", []), taken_over.get("pools", {}))
        self.replica_set.start_all()
        self._task = asyncio.create_task(self._loop())
        return adopted

    def published(self) -> dict:
        """What the fleet's other gateways follow, and its next leader adopts."""
        return {
            "replicas": self.replica_set.records(),
            "pools": {
                p.key: {
                    "version": p.version,
                    "desired": p.desired,
                    "model": p.model.model,
                    "replica_args": list(p.model.replica_args),
                }
                for p in self.pools
            },
            "snapshot": self.snapshot(),
            "decisions": list(self.history.decisions)[-50:],
        }

    async def detach(self) -> None:
        """Stops supervising and leaves the replicas running: another gateway leads them now."""
        await self._cancel_loop()

    async def _loop(self) -> None:
        rs = self.replica_set
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for slot in self.slots:
                try:
                    rs.tend(slot, now)
                except Exception:  # the supervisor must outlive any one replica's trouble
                    log.exception("%s: supervision failed; retrying", slot.name)
                    slot.next_start = now + rs._backoff(slot, now)
            for pool in self.pools:
                try:
                    self.reconcile(pool, now)
                except Exception:
                    log.exception("%s: reconcile failed; retrying", pool.key)
            self.history.sample(self.pools, self.signals, now)

    async def _cancel_loop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def stop(self) -> None:
        await self._cancel_loop()
        await self.replica_set.stop_all()
