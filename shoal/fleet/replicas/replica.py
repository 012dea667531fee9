"""One replica as the gateway sees it: health, circuit breaker, load, in-flight requests."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from shoal.fleet.replicas.latency import LatencyWindow

# Whole requests go to replicas with these roles; prefill workers take them only when none is left.
SERVING_ROLES = frozenset({"both", "decode"})
PREFILL_ROLES = frozenset({"prefill"})


class Lifecycle(StrEnum):
    """The controller's say: only a ready replica takes traffic. One per replica: a slot of the
    replica set and the replica's record in the table read and write the same one."""

    STARTING = "starting"  # its process loads the model
    STANDBY = "standby"  # loaded, takes no traffic until promoted
    READY = "ready"  # takes traffic
    DRAINING = "draining"  # takes no new traffic, finishes what it has
    STOPPED = "stopped"


class Health(StrEnum):
    """What probes and the circuit breaker say of a replica (its `state`)."""

    LOADING = "loading"  # up but not /ready: never routed to
    READY = "ready"
    EJECTED = "ejected"  # circuit open after consecutive failures
    HALF_OPEN = "half_open"  # one trial request decides
    DOWN = "down"  # unreachable or unhealthy by probe, or its process exited (restart pending)
    DRAINING = "draining"  # it said it shuts down (SIGTERM): no new requests, its streams move off
    PORT_IN_USE = "port_in_use"  # another process holds its port: the launcher does not start it


@dataclass
class Death:
    """The end of one life of a replica (it died, froze or its engine failed), as first seen.
    `suspects` are the attempts in flight on it then: the requests that may have caused it."""

    at: float
    reason: str
    suspects: frozenset = frozenset()
    exit_code: int | None = None  # of its process, when the launcher saw it exit
    engine_dead: bool = False  # the replica said its engine died (to any of its requests)
    instance: str | None = None  # the process it was then (see Replica.instance)
    unreachable: bool = False  # marked down because nothing answered a connect (a partition)


@dataclass
class Replica:
    name: str
    url: str
    state: Health = Health.LOADING
    inflight: int = 0
    load: dict = field(default_factory=dict)  # last /load answer (shoal replicas only)
    consecutive_failures: int = 0
    open_until: float = 0.0
    trial_inflight: bool = False
    recent_errors: deque = field(default_factory=lambda: deque(maxlen=10))
    requests_total: int = 0
    # Of those, failed here (a 5xx, a broken stream, no answer): see control/canary_judge.py.
    failed_total: int = 0
    abandoned_total: int = 0  # and stopped by the gateway before they had an outcome here
    pid: int | None = None
    kv_events: bool = False  # it answers /kv_events: the index is exact
    kv_instance: str | None = None
    kv_cursor: int = 0
    block_size: int | None = None
    # Lifecycle, for replicas the fleet starts itself: the process's exit code (None while it runs),
    # a note such as "port in use", restarts so far.
    proc_exit: Callable[[], int | None] | None = None
    note: str | None = None
    restarts: int = 0
    probe_misses: int = 0
    attempts: set = field(default_factory=set)  # requests in flight, interrupted when it goes down
    death: Death | None = None
    role: str = "both"  # prefill, decode or both (see shoal serve --role), from /load or the launcher
    model: str | None = None  # the model id it serves, in a fleet of several models
    # The controller's say; a replica it does not run (a --backend one) is always ready.
    lifecycle: Lifecycle = Lifecycle.READY
    version: int = 0  # of its pool's model config (rolling updates)
    node: str | None = None  # where a remote launcher placed it (a Ray node id)
    instance: str | None = None  # its process, as its /ready names it: the same after a partition
    latency: LatencyWindow = field(default_factory=LatencyWindow)  # its recent TTFTs and token gaps

    @property
    def process_alive(self) -> bool:
        return self.proc_exit is None or self.proc_exit() is None

    def begin_life(self) -> None:
        """Its process came up ready: what was learned of an earlier one (or of a stranger that
        held its port meanwhile) is void, the /load answer included."""
        self.consecutive_failures = 0
        self.death, self.note = None, None
        self.load = {}

    @property
    def outstanding(self) -> float:
        """Requests this replica is working on or queueing, as best known."""
        waiting = self.load.get("waiting", 0)
        return max(self.inflight, self.load.get("running", 0) + waiting) + 0.5 * waiting

    def routable(self, now: float) -> bool:
        if self.lifecycle != Lifecycle.READY:
            return False
        if self.state == Health.READY:
            return True
        if self.state == Health.EJECTED and now >= self.open_until:
            self.state = Health.HALF_OPEN
        return self.state == Health.HALF_OPEN and not self.trial_inflight

    def on_dispatch(self) -> None:
        self.inflight += 1
        self.requests_total += 1
        if self.state == Health.HALF_OPEN:
            self.trial_inflight = True

    def on_success(self) -> None:
        self.consecutive_failures = 0
        if self.state == Health.HALF_OPEN:
            self.state = Health.READY
        self.trial_inflight = False

    def on_failure(self, reason: str, eject_after: int, eject_for: float) -> bool:
        """Records a failed request; returns True when this failure opened the circuit."""
        self.recent_errors.append((time.time(), reason))
        self.consecutive_failures += 1
        self.trial_inflight = False
        if self.state == Health.HALF_OPEN or (
            self.state == Health.READY and self.consecutive_failures >= eject_after
        ):
            self.state = Health.EJECTED
            self.open_until = time.monotonic() + eject_for
            return True
        return False

    def snapshot(self) -> dict:
        return {
            "name": self.name,
            "url": self.url,
            "state": self.state.value,
            "inflight": self.inflight,
            "load": self.load,
            "requests_total": self.requests_total,
            "failed_total": self.failed_total,
            "abandoned_total": self.abandoned_total,
            "consecutive_failures": self.consecutive_failures,
            "recent_errors": [{"time": t, "error": e} for t, e in self.recent_errors],
            "pid": self.pid,
            "kv_events": self.kv_events,
            "restarts": self.restarts,
            "note": self.note,
            "role": self.role,
            "model": self.model,
            "lifecycle": self.lifecycle.value,
            "version": self.version,
            "node": self.node,
        }
