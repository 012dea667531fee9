"""The fleet's replica set: each model's pools of replica slots and the lifecycle of each slot.

A slot is one replica's place in the fleet (its name and port), whatever process fills it now:
starting (its process loads the model), standby (loaded, takes no traffic until promoted), ready
(takes traffic), draining (takes no new traffic, finishes what it has), stopped."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.fleet.config import FleetConfig, ModelConfig
from shoal.fleet.control.autoscaler import Autoscaler
from shoal.fleet.control.launchers.adopted import host_id
from shoal.fleet.control.launchers.base import Launcher, ReplicaSpec
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.replicas.replica import Health, Lifecycle, Replica
from shoal.fleet.replicas.table import ReplicaTable
from shoal.protocol import tracing
from shoal.protocol.kv_files import shm_sweep
from shoal.protocol.secrets import API_KEY_ENV, KV_SALT_ENV, KV_TRANSFER_KEY_ENV

log = logging.getLogger(__name__)

PORT_RECHECK_S = 1.0


@dataclass(eq=False)
class Slot:
    name: str
    pool: Pool
    port: int
    log_path: str
    host: str = "127.0.0.1"
    proc: object | None = None  # the launcher's handle: pid, poll(), terminate(), kill(), wait()
    restarts: int = 0
    started_at: float = 0.0  # when its current process was started
    quick_deaths: int = 0  # deaths in a row, each before it had stayed up restart_reset_after_s
    next_start: float = 0.0
    drain_since: float | None = None
    model: ModelConfig | None = None  # the version of the model config it runs
    version: int = 0
    surge: bool = False  # started beside the others by a rolling update
    attached: bool = False  # its process's address is known and in the table
    # Its record in the replica table (there once registered), which holds its one lifecycle.
    replica: Replica | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.replica is None:
            self.replica = Replica(self.name, self.url, lifecycle=Lifecycle.STARTING)

    @property
    def state(self) -> Lifecycle:
        return self.replica.lifecycle

    @state.setter
    def state(self, state: Lifecycle) -> None:
        self.replica.lifecycle = state

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(eq=False)
class Pool:
    """The replicas of one model in one role, and how many of them should take traffic."""

    model: ModelConfig
    role: str
    min: int
    max: int
    autoscaler: Autoscaler | None  # None: a fixed pool of `min` replicas
    slots: list[Slot] = field(default_factory=list)
    desired: int = 0  # active replicas wanted now
    decision: str = ""  # why, as the autoscaler last said
    raised_at: float = 0.0  # when the autoscaler last asked for more
    version: int = 0  # of `model`, the target; replicas of other versions are rolled over to it
    rollout: object | None = None  # a rolling update in progress (see rollout.py)
    last_rollout: str = ""
    last_judgement: dict = field(default_factory=dict)  # its figures: see rollout.py
    evicted_at: float | None = None  # unloaded for memory; back at its next request

    @property
    def key(self) -> str:
        return self.model.key if self.role == "both" else f"{self.model.key}/{self.role}"

    @property
    def warm(self) -> int:
        return self.model.warm_standby if self.autoscaler is not None and self.evicted_at is None else 0

    def in_state(self, *states: Lifecycle) -> list[Slot]:
        return [s for s in self.slots if s.state in states]


class ReplicaSet:
    """Every pool's slots and the operations on them: create, start, restart with backoff, move
    between lifecycle states, stop. The controller decides; this carries it out, through the
    launcher, and keeps the replica table in step."""

    def __init__(
        self,
        config: FleetConfig,
        launcher: Launcher,
        table: ReplicaTable,
        metrics: GatewayMetrics,
        notify: Callable[[], None],
        log_dir: str,
    ):
        self.config = config
        self.launcher = launcher
        self.table = table
        self.metrics = metrics
        self.notify = notify  # a replica came or went: requests waiting for one look again
        self.log_dir = log_dir
        self.multi_model = bool(config.models)
        self.pools: list[Pool] = []
        self._index = 0

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

    def pool_for(self, model: str | None, role: str = "both") -> Pool | None:
        for p in self.pools:
            if p.role == role and (not self.multi_model or p.model.name == model):
                return p
        return None

    # --- processes -----------------------------------------------------------------------

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
        if gw.otlp_traces_endpoint:  # its replicas' spans go where the gateway's go
            env[tracing.ENDPOINT_ENV] = gw.otlp_traces_endpoint
        return ReplicaSpec(slot.name, slot.port, slot.log_path, m.model, args, env, m.memory_mb)

    def _start(self, slot: Slot) -> bool:
        """Starts `slot` unless its port is taken (then it shows as port_in_use until it is free)."""
        if slot.port and self.launcher.port_in_use(slot.port):
            rep = self.register(slot)  # a slot added by scaling up is not registered yet
            if rep.state != Health.PORT_IN_USE:
                log.warning("%s: port %d is in use by another process; not starting it", slot.name, slot.port)
            self.table.port_in_use(
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
        self.register(slot, slot.proc).node = slot.proc.node
        slot.attached = True

    def register(self, slot: Slot, proc=None):
        """The slot's replica in the table (a new life of it, given its process)."""
        pid, poll = (proc.pid, proc.poll) if proc is not None else (None, None)
        rep = self.table.add(slot.name, slot.url, pid, poll, slot.replica)
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

    def tend(self, slot: Slot, now: float) -> None:
        """Restarts a slot whose process died (unless it was leaving anyway)."""
        if slot.proc is not None:
            self._attach(slot)
            code = slot.proc.poll()
            if code is None:
                return
            if slot.name in self.table.replicas:
                self.table.mark_down(slot.name, f"process exited with {code}", code)
            if slot.proc.pid is not None and slot.proc.node is None:
                shm_sweep(slot.proc.pid)  # K/V it was handing over when it died (on this host)
            slot.proc = None
            if slot.state in (Lifecycle.DRAINING, Lifecycle.STOPPED):
                return self._remove(slot)
            slot.restarts += 1
            delay = self._backoff(slot, now)
            slot.next_start = now + delay
            slot.state = Lifecycle.STARTING
            log.warning("%s exited with %s; restarting in %.1f s", slot.name, code, delay)
        elif slot.state != Lifecycle.STOPPED and now >= slot.next_start and not self._start(slot):
            slot.next_start = now + PORT_RECHECK_S

    def set_state(self, slot: Slot, state: Lifecycle, why: str) -> None:
        if slot.state != state:
            log.info("%s: %s -> %s (%s)", slot.name, slot.state.value, state.value, why)
            if state == Lifecycle.READY:  # cold: its process's start; warm: the need for it
                warm = slot.state == Lifecycle.STANDBY
                since = slot.pool.raised_at if warm else slot.started_at
                self.metrics.replica_start.labels("warm" if warm else "cold").observe(
                    time.monotonic() - since
                )
            slot.state = state
            slot.drain_since = time.monotonic() if state == Lifecycle.DRAINING else None
            if state == Lifecycle.DRAINING and slot.name in self.table.replicas:
                # Its streams go on elsewhere now, instead of holding the drain for their length.
                moved = self.table.move_streams(slot.name)
                if moved:
                    log.info("%s: %d streams moved to other replicas", slot.name, moved)
            self.notify()

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
        self.table.remove(slot.name)

    def start_all(self) -> None:
        """Called on the event loop's thread, which spawns every replica (see launchers) but those
        adopted, which run already."""
        for slot in self.slots:
            if slot.proc is not None:
                rep = self.register(slot)  # without a new life: it keeps the health it has
                rep.pid, rep.proc_exit, slot.attached = slot.proc.pid, slot.proc.poll, True
                continue
            if slot.port:  # known before its start: shown (and port-checked) from now
                self.register(slot)
            self._start(slot)

    # --- several gateways: the replica set in the shared store ---------------------------

    def records(self) -> list[dict]:
        """Each slot as the fleet's next leader needs it to adopt its process."""
        here = host_id()
        out = []
        for s in self.slots:
            if s.state == Lifecycle.STOPPED:
                continue
            local = s.proc is not None and s.proc.node is None and s.proc.pid is not None
            out.append(
                {
                    "name": s.name,
                    "url": s.url,
                    "pool": s.pool.key,
                    "served": s.pool.model.name,
                    "role": s.pool.role,
                    "host": s.host,
                    "port": s.port,
                    "log_path": s.log_path,
                    "pid": s.proc.pid if local else None,
                    "started": s.proc.started if local else None,
                    "host_id": here,
                    "state": s.state.value,
                    "version": s.version,
                    "model": s.model.model,
                    "replica_args": list(s.model.replica_args),
                    "restarts": s.restarts,
                }
            )
        return out

    def adopt(self, records: list[dict], pools: dict[str, dict]) -> int:
        """Takes over the replica set the fleet's earlier leader published: its pools' targets,
        and its slots, with their processes where they still run here (the others start again).
        Returns the processes adopted."""
        by_key = {p.key: p for p in self.pools}
        for key, p in pools.items():
            if key in by_key:
                pool = by_key[key]
                pool.version, pool.desired = p["version"], p["desired"]
                pool.model = dataclasses.replace(pool.model, model=p["model"], replica_args=p["replica_args"])
        if not records:
            return 0
        for pool in self.pools:
            pool.slots.clear()  # placeholders of a fresh start, never started
        adopted = 0
        for r in records:
            pool = by_key.get(r["pool"])
            if pool is None:
                log.warning(
                    "%s: its pool %s is not in this gateway's config; left alone", r["name"], r["pool"]
                )
                continue
            slot = Slot(
                r["name"],
                pool,
                r["port"],
                r["log_path"],
                r["host"],
                replica=self.table.replicas.get(r["name"]),
            )
            slot.model = dataclasses.replace(pool.model, model=r["model"], replica_args=r["replica_args"])
            slot.version, slot.restarts = r["version"], r["restarts"]
            slot.state = Lifecycle(r["state"])
            slot.started_at = time.monotonic()
            if r["pid"] is not None:
                slot.proc = self.launcher.adopt(r["pid"], r["started"], r["host_id"], (r["host"], r["port"]))
            if slot.proc is None:
                slot.state = Lifecycle.STARTING  # it died with the leader, or lives where we cannot reach it
            else:
                adopted += 1
            pool.slots.append(slot)
            self._index = max(self._index, int(r["name"].rsplit("-", 1)[-1]) + 1)
        return adopted

    async def stop_all(self) -> None:
        procs = [s.proc for s in self.slots if s.proc is not None]
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                await asyncio.to_thread(p.wait, 15)
            except subprocess.TimeoutExpired:
                p.kill()
        self.launcher.shutdown()
