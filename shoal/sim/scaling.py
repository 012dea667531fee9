"""An autoscaled pool in simulated time: the fleet controller's rules (shoal.fleet.control) over
the exact simulator's replicas. The real Autoscaler decides from the same signals the gateway
gives it; as the controller does, a replica it asks for comes from the warm standbys at once, or
else starts cold and takes traffic after the profile's start-up time (beside busy replicas when
the pool has any) and the gateway's next probe of it; one it no longer needs stops taking requests
and leaves once its own are done, or stays loaded when the standby pool is short."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.fleet.config import GatewayConfig
from shoal.fleet.control.autoscaler import AutoscaleConfig, Autoscaler, Signals
from shoal.protocol.bounds import check_bounds
from shoal.sim.profile import NodeProfile

TICK_S = 0.1  # as often as the controller reconciles
TTFT_WINDOW_S = 30.0  # the window of the TTFT signal, as the controller keeps it

OFF, STARTING, STANDBY, ACTIVE, DRAINING = "off", "starting", "standby", "active", "draining"


@dataclass
class ScalingShape:
    min_replicas: int = 1
    max_replicas: int = 4
    warm_standby: int = 0
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    scale_to_zero_after_s: float | None = None
    start_s: float | None = None  # a cold start's seconds; None: the profile's (startup_timing.py)
    # How often the gateway probes a replica for readiness: a started one takes traffic at the
    # first probe after its server is ready, half an interval later on average.
    probe_interval_s: float = GatewayConfig.probe_interval_s

    def __post_init__(self):
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                f"need 0 <= min_replicas ({self.min_replicas}) <= max_replicas ({self.max_replicas}), "
                "and max_replicas of at least 1"
            )
        least = {"warm_standby": 0, "scale_to_zero_after_s": 0, "start_s": 0}
        check_bounds(self, least, above={"probe_interval_s": 0})
        self.autoscale.check()

    @property
    def slots(self) -> int:
        """Replicas the pool can have up at once: as the controller's, its standbys on top of its
        active maximum."""
        return self.max_replicas + self.warm_standby


@dataclass
class Load:
    """What the pool reads of its replicas and of the gateway at a tick."""

    inflight: list[int]  # per replica: requests in its hands
    waiting: list[int]  # per replica: requests queued in its engine
    kv_usage: list[float]  # per replica: its KV-cache usage (0-1)
    queued: int  # requests held at the gateway for want of an active replica
    ttft_p90: float | None
    idle_s: float


class SimPool:
    @classmethod
    def of(cls, shape: ScalingShape, profile: NodeProfile) -> SimPool:
        """A pool whose cold start takes what the profile measured, unless the shape says: its
        second start (the caches warm, as a replacement's are), or its start beside a busy replica
        while the pool has an active one (a scale-up under load); each found ready at the gateway's
        next probe."""
        found = shape.probe_interval_s / 2
        start = shape.start_s
        if start is not None:
            return cls(shape, start + found)
        alone = profile.startup_s.get("again", profile.startup_s.get("first", 0.0))
        return cls(shape, alone + found, profile.startup_s.get("busy", alone) + found)

    def __init__(self, shape: ScalingShape, start_s: float, busy_start_s: float | None = None):
        self.shape = shape
        self.start_s = start_s  # a cold start's seconds with no replica of the pool active
        self.busy_start_s = start_s if busy_start_s is None else busy_start_s  # ... with one
        self.autoscaler = Autoscaler(
            shape.autoscale, shape.min_replicas, shape.max_replicas, shape.scale_to_zero_after_s
        )
        self.state = [OFF] * shape.slots
        self.ready_at: dict[int, float] = {}
        self.up_since: dict[int, float] = {}
        self.up_total = 0.0
        self.desired = shape.min_replicas
        self.decisions: list[tuple[float, int, str]] = []  # (when, desired, why)
        self.stopped: list[int] = []  # replicas that went down since the fleet last took them

    def with_state(self, *states: str) -> list[int]:
        return [i for i, s in enumerate(self.state) if s in states]

    @property
    def active(self) -> list[int]:
        return self.with_state(ACTIVE)

    def start(self, now: float) -> None:
        """The fleet's start: its first replicas are loaded before the first request."""
        for i in range(self.shape.min_replicas + self._warm()):
            self._up(i, now)
            self.state[i] = ACTIVE if i < self.shape.min_replicas else STANDBY

    def _warm(self) -> int:
        return self.shape.warm_standby

    def _up(self, i: int, now: float) -> None:
        self.up_since[i] = now

    def _down(self, i: int, now: float) -> None:
        self.state[i] = OFF
        self.up_total += now - self.up_since.pop(i)
        self.stopped.append(i)

    def take_stopped(self) -> list[int]:
        """The replicas that went down since the last call: one started again in a slot holds
        nothing of its cache, as a new process would not."""
        stopped, self.stopped = self.stopped, []
        return stopped

    def replica_seconds(self, now: float) -> float:
        return self.up_total + sum(now - t for t in self.up_since.values())

    def tick(self, now: float, load: Load) -> None:
        """One reconcile: the autoscaler's decision, then the replicas moved toward it."""
        active = self.active
        signals = Signals(
            active=len(active),
            inflight=sum(load.inflight[i] for i in active),
            queued=load.queued,
            waiting=sum(load.waiting[i] for i in active),
            kv_usage=sum(load.kv_usage[i] for i in active) / max(1, len(active)),
            ttft_p90=load.ttft_p90,
            idle_s=load.idle_s,
            desired=self.desired,
        )
        d = self.autoscaler.decide(signals, now)
        if d.changed and d.desired != self.desired:
            self.decisions.append((now, d.desired, d.reason))
        self.desired = d.desired
        for i in self.with_state(STARTING):
            if self.ready_at[i] <= now:
                del self.ready_at[i]
                self.state[i] = ACTIVE if len(self.active) < self.desired else STANDBY
        standby = self.with_state(STANDBY)
        while len(self.active) < self.desired and standby:
            self.state[standby.pop()] = ACTIVE
        for i in self.with_state(DRAINING):
            if load.inflight[i] == 0:
                if len(self.with_state(STANDBY)) < self._warm():
                    self.state[i] = STANDBY
                else:
                    self._down(i, now)
        spares = self.with_state(STARTING, STANDBY)
        want = max(0, self.desired - len(self.active)) + self._warm()
        start_s = self.busy_start_s if self.active else self.start_s
        for i in self.with_state(OFF)[: max(0, want - len(spares))]:
            self.state[i] = STARTING
            self.ready_at[i] = now + start_s
            self._up(i, now)
        for i in sorted(spares, key=lambda i: self.state[i] == STANDBY)[: max(0, len(spares) - want)]:
            self.ready_at.pop(i, None)
            self._down(i, now)
        active = self.active
        if len(active) > self.desired:
            for i in sorted(active, key=lambda i: load.inflight[i])[: len(active) - self.desired]:
                self.state[i] = DRAINING

    def next_ready(self) -> float | None:
        return min(self.ready_at.values(), default=None)
