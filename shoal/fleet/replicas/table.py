"""The replica table: every replica the gateway routes to, and the record of each one's deaths.
Health probing fills it in (health.py); admission reads it to dispatch (admission/dispatch.py)."""

from __future__ import annotations

import contextlib
import time

from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.replica import SERVING_ROLES, Death, Health, Replica


class ReplicaTable:
    def __init__(self, index: PrefixIndex, metrics: GatewayMetrics, default_block_size: int):
        self.index = index  # what each replica caches: void when it dies or leaves
        self.metrics = metrics
        self.default_block_size = default_block_size
        self.replicas: dict[str, Replica] = {}

    def add(
        self, name: str, url: str, pid: int | None = None, proc_exit=None, replica: Replica | None = None
    ) -> Replica:
        """A replica (`replica`, when its slot made its record), or a new life of one (its process
        restarted): probes decide when it is ready."""
        r = self.replicas.get(name)
        if r is None:
            r = self.replicas[name] = replica or Replica(name, url.rstrip("/"))
        r.url, r.pid = url.rstrip("/"), pid
        if proc_exit is not None:
            r.proc_exit = proc_exit
            r.state, r.death, r.note, r.probe_misses = Health.LOADING, None, None, 0
        return r

    def remove(self, name: str) -> None:
        """A replica the controller stopped: gone from routing, its cache from the index."""
        r = self.replicas.pop(name, None)
        if r is not None:
            self.index.reset(name)
            for gauge in (self.metrics.replica_up, self.metrics.inflight):
                with contextlib.suppress(KeyError):
                    gauge.remove(name)

    def witness(self, r: Replica, reason: str, exit_code: int | None = None) -> Death:
        """Records (once per life) that `r` died, with the requests in flight on it then."""
        if r.death is None:
            r.death = Death(time.monotonic(), reason, frozenset(r.attempts), exit_code, instance=r.instance)
        elif exit_code is not None:
            r.death.exit_code = exit_code
        return r.death

    def mark_down(self, name: str, reason: str, exit_code: int | None = None) -> None:
        """Takes a replica out of routing and fails over every request relayed from it at once."""
        r = self.replicas[name]
        if r.state != Health.DOWN:
            r.recent_errors.append((time.time(), reason))
        r.state = Health.DOWN
        self.witness(r, reason, exit_code)
        self.index.reset(name)
        for attempt in list(r.attempts):
            attempt.interrupt()

    def move_streams(self, name: str, limit: int | None = None) -> int:
        """Moves the streams relayed from a replica to others, their K/V copied from it (it leaves
        service, or is too busy: `limit` streams, the least urgent and then the longest first, so
        that a burst of interactive requests finds room where batch work ran): when another
        replica of its model takes requests. Returns how many began to move (one whose copy
        fails stays)."""
        r = self.replicas.get(name)
        if r is None or not any(o is not r for o in self.serving(r.model, time.monotonic())):
            return 0
        movable = [a for a in r.attempts if a.movable and not a.move_asked]
        moving = sorted(movable, key=lambda a: (a.priority, a.tokens), reverse=True)[:limit]
        for attempt in moving:
            attempt.move()
        return len(moving)

    def saw_draining(self, name: str) -> None:
        """The replica said it shuts down (a 503 `draining`, or its /ready): it takes no request
        from now on, and its streams move to other replicas while it still answers for their K/V
        (those that cannot move finish there, within its shutdown timeout)."""
        r = self.replicas.get(name)
        if r is None or r.state in (Health.DRAINING, Health.DOWN, Health.PORT_IN_USE):
            return
        r.state = Health.DRAINING
        r.recent_errors.append((time.time(), "draining: it shuts down"))
        self.move_streams(name)

    def port_in_use(self, name: str, note: str) -> None:
        r = self.replicas[name]
        if r.state != Health.PORT_IN_USE:
            r.recent_errors.append((time.time(), note))
        r.state, r.note, r.pid, r.proc_exit = Health.PORT_IN_USE, note, None, None
        self.index.reset(name)

    @property
    def block_size(self) -> int:
        """The replicas' KV block size (they agree), or the configured one until they say."""
        sizes = {r.block_size for r in self.replicas.values() if r.block_size}
        return sizes.pop() if len(sizes) == 1 else self.default_block_size

    def has_role(self, roles: frozenset) -> bool:
        return any(r.role in roles for r in self.replicas.values())

    def routable(self, model: str | None, now: float, roles: frozenset | None = None) -> list[Replica]:
        """The model's replicas that take a request now (of `roles`, when given)."""
        return [
            r
            for r in self.replicas.values()
            if r.model == model and (roles is None or r.role in roles) and r.routable(now)
        ]

    def serving(self, model: str | None, now: float) -> list[Replica]:
        return self.routable(model, now, SERVING_ROLES)

    def ready(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state == Health.READY]
