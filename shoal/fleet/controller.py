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
import subprocess
import tempfile
import time

from shoal.fleet.autoscaler import Autoscaler, Signals
from shoal.fleet.config import FleetConfig
from shoal.fleet.cores import CoreAllocator, planned_replicas
from shoal.fleet.history import FleetHistory
from shoal.fleet.launcher import LocalLauncher, ReplicaSpec
from shoal.fleet.placement import Placement
from shoal.fleet.replica import ReplicaState
from shoal.fleet.replica_set import Lifecycle, Pool, Slot
from shoal.fleet.rollout import RolloutDriver
from shoal.protocol.kv_files import shm_sweep
from shoal.protocol.secrets import API_KEY_ENV, KV_SALT_ENV, KV_TRANSFER_KEY_ENV

log = logging.getLogger(__name__)

TICK_S = 0.1
PORT_RECHECK_S = 1.0
TTFT_WINDOW_S = 30.0


class FleetController:
    def __init__(self, config: FleetConfig, launcher=None):
        self.config = config
        self.models = config.model_configs()
        if launcher is None:  # this host's cores, shared by as many replicas as the fleet may run
            launcher = LocalLauncher(CoreAllocator.for_fleet(config.cores, planned_replicas(self.models)))
        self.launcher = launcher
        gw = config.gateway
        # One salt per fleet, shared by its replicas (through the environment: argv is public) and
        # its gateway, so that the router's block hashes are the replicas' own; likewise the key
        # of K/V handoffs between its workers.
        if not gw.kv_salt:
            gw.kv_salt = os.environ.get(KV_SALT_ENV) or secrets.token_hex(16)
        if not gw.kv_transfer_key:
            gw.kv_transfer_key = secrets.token_hex(16)
        self.log_dir = tempfile.mkdtemp(prefix="shoal-fleet-")
        self.multi_model = bool(config.models)
        self.pools: list[Pool] = []
        self._index = 0
        self.registry = None
        self.rollouts = RolloutDriver(self)
        self.placement = Placement(self, config.memory_budget_mb)
        self.history = FleetHistory()
        self._task: asyncio.Task | None = None
        self.started = time.monotonic()
        for m in self.models:
            for role, lo, hi in m.pools():
                # Disaggregated pools are fixed; so is a pool whose bounds leave nothing to decide.
                fixed = role != "both" or (
                    lo == hi and not m.warm_standby and m.scale_to_zero_after_s is None
                )
                scaler = None if fixed else Autoscaler(m.autoscale, lo, hi, m.scale_to_zero_after_s)
                pool = Pool(m, role, lo, hi, scaler, desired=lo)
                self.pools.append(pool)
                for _ in range(lo + pool.warm):
                    self.new_slot(pool)

    # --- the replica set -----------------------------------------------------------------

    @property
    def slots(self) -> list[Slot]:
        return [s for p in self.pools for s in p.slots]

    def new_slot(self, pool: Pool) -> Slot:
        i = self._index
        self._index += 1
        port = self.launcher.port_for(self.config.base_port, i)
        if self.multi_model:
            name = f"{pool.model.name}-{i}" if pool.role == "both" else f"{pool.model.name}-{pool.role}-{i}"
        else:
            name = f"replica-{i}" if pool.role == "both" else f"{pool.role}-{i}"
        slot = Slot(name, pool, port, os.path.join(self.log_dir, f"{name}.log"), self.launcher.host)
        slot.model, slot.version = pool.model, pool.version
        pool.slots.append(slot)
        return slot

    def busy_ports(self) -> list[int]:
        return [s.port for s in self.slots if s.port and self.launcher.port_in_use(s.port)]

    def serves(self, model: str | None) -> bool:
        return not self.multi_model or any(m.name == model for m in self.models)

    def pool_for(self, model: str | None, role: str = "both") -> Pool | None:
        for p in self.pools:
            if p.role == role and (not self.multi_model or p.model.name == model):
                return p
        return None

    def wake(self, model: str | None) -> bool:
        """A request waits for `model` and none of its replicas takes traffic: True when one is
        coming (starting, standby to promote, or one to start), so that the request should wait."""
        pool = self.pool_for(model)
        # A fixed pool's replicas come back only by restarting: its requests fail over or get 503.
        return pool is not None and pool.autoscaler is not None and pool.max > 0

    # --- lifecycle -----------------------------------------------------------------------

    def _spec(self, slot: Slot) -> ReplicaSpec:
        m, gw = slot.model, self.config.gateway
        args = list(m.replica_args)
        if m.name:
            args += ["--served-model-name", m.name]
        if slot.pool.role != "both":
            args += ["--role", slot.pool.role]
        # Secrets by environment, never argv (public in ps); an empty key overrides an inherited one.
        env = {KV_SALT_ENV: gw.kv_salt, KV_TRANSFER_KEY_ENV: gw.kv_transfer_key}
        env[API_KEY_ENV] = gw.replica_key or ""
        return ReplicaSpec(slot.name, slot.port, slot.log_path, m.model, args, env, m.memory_mb)

    def _publish(self, slot: Slot) -> None:
        rep = self.registry.replicas.get(slot.name)
        if rep is not None:
            rep.lifecycle = slot.state.value

    def _start(self, slot: Slot) -> bool:
        """Starts `slot` unless its port is taken (then it shows as port_in_use until it is free)."""
        if slot.port and self.launcher.port_in_use(slot.port):
            rep = self._register(slot)  # a slot added by scaling up is not registered yet
            if rep.state != ReplicaState.PORT_IN_USE:
                log.warning("%s: port %d is in use by another process; not starting it", slot.name, slot.port)
            self.registry.port_in_use(
                slot.name,
                f"port {slot.port} is in use by another process; {slot.name} waits for it to be free",
            )
            return False
        slot.proc = self.launcher.spawn(self._spec(slot))
        slot.started_at = time.monotonic()
        slot.state = Lifecycle.STARTING
        slot.attached = False
        self._attach(slot)
        return True

    def _attach(self, slot: Slot) -> None:
        """Routes to the slot's process once the launcher knows where it listens (a remote
        launcher learns that only after placing it)."""
        if slot.attached or slot.proc.address is None:
            return
        slot.host, slot.port = slot.proc.address
        self._register(slot, slot.proc).node = slot.proc.node
        slot.attached = True
        self._publish(slot)

    def _register(self, slot: Slot, proc=None):
        """The slot's replica in the registry (a new life of it, given its process)."""
        pid, poll = (proc.pid, proc.poll) if proc is not None else (None, None)
        rep = self.registry.add(slot.name, slot.url, pid, poll)
        rep.restarts, rep.role, rep.model, rep.version = (
            slot.restarts,
            slot.pool.role,
            slot.pool.model.name,
            slot.version,
        )
        return rep

    def start_slot(self, slot: Slot, now: float) -> None:
        if not self._start(slot):
            slot.next_start = now + PORT_RECHECK_S

    def _backoff(self, slot: Slot, now: float) -> float:
        cfg = self.config
        if now - slot.started_at >= cfg.restart_reset_after_s:
            slot.quick_deaths = 0
        delay = min(cfg.restart_backoff_max_s, cfg.restart_backoff_s * 2**slot.quick_deaths)
        slot.quick_deaths += 1
        return delay

    def _tend(self, slot: Slot, now: float) -> None:
        """Restarts a slot whose process died (unless it was leaving anyway)."""
        if slot.proc is not None:
            self._attach(slot)
            code = slot.proc.poll()
            if code is None:
                return
            if slot.name in self.registry.replicas:
                self.registry.mark_down(slot.name, f"process exited with {code}", code)
            if slot.proc.pid is not None and slot.proc.node is None:
                shm_sweep(slot.proc.pid)  # K/V it was handing over when it died (on this host)
            slot.proc = None
            if slot.state in (Lifecycle.DRAINING, Lifecycle.STOPPED):
                return self._remove(slot)
            slot.restarts += 1
            delay = self._backoff(slot, now)
            slot.next_start = now + delay
            slot.state = Lifecycle.STARTING
            self._publish(slot)
            log.warning("%s exited with %s; restarting in %.1f s", slot.name, code, delay)
        elif slot.state != Lifecycle.STOPPED and now >= slot.next_start and not self._start(slot):
            slot.next_start = now + PORT_RECHECK_S

    def set_state(self, slot: Slot, state: Lifecycle, why: str) -> None:
        if slot.state != state:
            log.info("%s: %s -> %s (%s)", slot.name, slot.state.value, state.value, why)
            if state == Lifecycle.READY:  # cold: its process's start; warm: the need for it
                warm = slot.state == Lifecycle.STANDBY
                since = slot.pool.raised_at if warm else slot.started_at
                self.registry.metrics.replica_start.labels("warm" if warm else "cold").observe(
                    time.monotonic() - since
                )
            slot.state = state
            slot.drain_since = time.monotonic() if state == Lifecycle.DRAINING else None
            self._publish(slot)
            self.registry.notify_nowait()

    def stop_slot(self, slot: Slot, why: str) -> None:
        self.set_state(slot, Lifecycle.STOPPED, why)
        if slot.proc is not None:
            slot.proc.terminate()
        else:
            self._remove(slot)

    def _remove(self, slot: Slot) -> None:
        slot.state = Lifecycle.STOPPED
        if slot in slot.pool.slots:
            slot.pool.slots.remove(slot)
        self.registry.remove(slot.name)

    # --- reconcile -----------------------------------------------------------------------

    def signals(self, pool: Pool, now: float) -> Signals:
        reg = self.registry
        active = [reg.replicas[s.name] for s in pool.in_state(Lifecycle.READY) if s.name in reg.replicas]
        key = pool.model.name
        ttft = reg.ttft_p90(key, now - TTFT_WINDOW_S)
        return Signals(
            active=len(active),
            inflight=sum(r.inflight for r in active),
            queued=reg.queued.get(key, 0),
            waiting=sum(r.load.get("waiting", 0) for r in active),
            kv_usage=sum(r.load.get("kv_usage", 0.0) for r in active) / max(1, len(active)),
            ttft_p90=ttft,
            idle_s=now - reg.last_request.get(key, self.started),
            desired=pool.desired,
        )

    def reconcile(self, pool: Pool, now: float) -> None:
        reg = self.registry
        if pool.rollout is not None:
            self.rollouts.step(pool, now)
        key = pool.model.name
        if pool.evicted_at is not None and (
            reg.queued.get(key) or reg.last_request.get(key, 0) > pool.evicted_at
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
                reg.metrics.autoscaler_decisions.labels(pool.key, direction, d.signal).inc()
                self.history.decision(pool.key, pool.desired, d.desired, d.reason)
            pool.desired, pool.decision = d.desired, d.reason
        loaded = [
            s
            for s in pool.in_state(Lifecycle.STARTING)
            if s.name in reg.replicas and reg.replicas[s.name].state == ReplicaState.READY
        ]
        active = pool.in_state(Lifecycle.READY)
        for s in loaded:
            if len(active) < pool.desired:
                self.set_state(s, Lifecycle.READY, "loaded, needed")
                active.append(s)
            else:
                self.set_state(s, Lifecycle.STANDBY, "loaded, kept warm")
        standby = pool.in_state(Lifecycle.STANDBY)
        while len(active) < pool.desired and standby:
            s = standby.pop()
            self.set_state(s, Lifecycle.READY, "promoted")
            active.append(s)
        for s in pool.in_state(Lifecycle.DRAINING):
            self._drain_step(s, now, len(standby) < pool.warm and s.version == pool.version)
        # Spares: what is starting or standing by, beyond the active replicas still missing (a
        # rolling update's surge replica is the update's own).
        spares = [s for s in pool.in_state(Lifecycle.STARTING, Lifecycle.STANDBY) if not s.surge]
        want = max(0, pool.desired - len(active)) + pool.warm
        for _ in range(want - len(spares)):
            if not self.launcher.has_room():
                break  # no free cores (cores.when_full = "wait"): started once a replica's are free
            if not self.placement.fits(pool):
                self.placement.make_room(pool, now)
                break  # placed once the memory is free
            self.start_slot(self.new_slot(pool), now)
        old_first = sorted(spares, key=lambda s: (s.version == pool.version, s.state == Lifecycle.STANDBY))
        for s in old_first[: max(0, len(spares) - want)]:
            self.stop_slot(s, "not needed")
        if len(active) > pool.desired:
            by_load = sorted(
                active, key=lambda s: reg.replicas[s.name].inflight if s.name in reg.replicas else 0
            )
            for s in by_load[: len(active) - pool.desired]:
                self.set_state(s, Lifecycle.DRAINING, pool.decision or "scale-down")
        reg.metrics.desired.labels(pool.key).set(pool.desired)
        for state in Lifecycle:
            reg.metrics.lifecycle.labels(pool.key, state.value).set(len(pool.in_state(state)))

    def _drain_step(self, slot: Slot, now: float, keep_warm: bool) -> None:
        rep = self.registry.replicas.get(slot.name)
        busy = rep is not None and rep.inflight > 0
        if busy and now - slot.drain_since < self.config.drain_timeout_s:
            return
        if keep_warm and rep is not None and rep.state == ReplicaState.READY:
            self.set_state(slot, Lifecycle.STANDBY, "drained, kept warm")
        else:
            self.stop_slot(slot, "drained" if not busy else "drain timed out")

    def update(
        self, model: str | None, changes: dict, canary: float = 0.0, canary_s: float = 30.0
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
            self.rollouts.begin(p, dataclasses.replace(p.model, **changes), canary, canary_s, now)
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
                "memory_mb": p.model.memory_mb,
                "unloaded": p.evicted_at is not None,
                "replicas": {s.name: s.state.value for s in p.slots},
                "versions": {s.name: s.version for s in p.slots},
                "cores": {s.name: getattr(s.proc, "cpus", None) for s in p.slots},
            }
            for p in self.pools
        ]

    # --- the loop ------------------------------------------------------------------------

    async def start(self, registry) -> None:
        """Called on the event loop's thread, which spawns every replica (see launcher)."""
        self.registry = registry
        registry.controller = self
        for slot in self.slots:
            if slot.port:  # known before its start: shown (and port-checked) from now
                self._register(slot)
            self._start(slot)
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for slot in self.slots:
                try:
                    self._tend(slot, now)
                except Exception:  # the supervisor must outlive any one replica's trouble
                    log.exception("%s: supervision failed; retrying", slot.name)
                    slot.next_start = now + self._backoff(slot, now)
            for pool in self.pools:
                try:
                    self.reconcile(pool, now)
                except Exception:
                    log.exception("%s: reconcile failed; retrying", pool.key)
            self.history.sample(self, now)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        procs = [s.proc for s in self.slots if s.proc is not None]
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                await asyncio.to_thread(p.wait, 15)
            except subprocess.TimeoutExpired:
                p.kill()
        self.launcher.shutdown()
