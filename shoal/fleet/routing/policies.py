"""Routing policies: each picks one replica from the routable candidates and says why."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.replica import Replica


@dataclass
class RouteRequest:
    hashes: list[int] = field(default_factory=list)  # the prompt's block hashes, if known
    session: str | None = None
    cached_blocks: int = 0  # set by dispatch: leading blocks the chosen replica already held
    model: str | None = None  # the model asked for, in a fleet of several (None: the only one)
    adapter: str | None = None  # the LoRA adapter it names, over `model` (routing/adapters.py)
    # Admission: whose request, at which priority (lower first), about how many prompt tokens
    # (charged to the tenant's fair share once, when it is first dispatched).
    tenant: str = "anonymous"
    priority: int = 0
    tokens: int = 0
    charged: bool = False
    span: object | None = None  # the request's trace span (protocol/tracing.py): routing is traced under it


class Policy(Protocol):
    """Picks one replica from the routable candidates (never empty) and says why (a metric label)."""

    name: str

    def choose(self, candidates: list[Replica], req: RouteRequest) -> tuple[Replica, str]: ...


def least_loaded(candidates: list[Replica]) -> Replica:
    return min(candidates, key=lambda r: (r.outstanding, r.requests_total))


class RoundRobin:
    name = "round_robin"

    def __init__(self):
        self._next = 0

    def choose(self, candidates, req):
        r = candidates[self._next % len(candidates)]
        self._next += 1
        return r, "round_robin"


class LeastLoad:
    name = "least_load"

    def choose(self, candidates, req):
        return least_loaded(candidates), "least_load"


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def choose(self, candidates, req):
        if len(candidates) == 1:
            return candidates[0], "only_choice"
        a, b = self.rng.sample(candidates, 2)
        return (a if a.outstanding <= b.outstanding else b), "power_of_two"


def _affinity(session: str, replica: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{session}|{replica}".encode()).digest()[:8], "little")


class Session:
    """Sticky by session key with rendezvous hashing: a session keeps its replica while that one is
    routable, and only the sessions of a lost replica move."""

    name = "session"

    def choose(self, candidates, req):
        if not req.session:
            return least_loaded(candidates), "no_session"
        best = max(candidates, key=lambda r: _affinity(req.session, r.name))
        return best, "session"


class KVAware:
    """Lowest cost = prompt blocks the replica lacks + load_weight x its outstanding requests; when
    load is too uneven, the least loaded replica wins whatever it holds."""

    name = "kv_aware"

    def __init__(self, index: PrefixIndex, load_weight: float, imbalance_limit: int):
        self.index = index
        self.load_weight = load_weight
        self.imbalance_limit = imbalance_limit

    def choose(self, candidates, req):
        loads = [r.outstanding for r in candidates]
        if max(loads) - min(loads) > self.imbalance_limit:
            return least_loaded(candidates), "imbalance_fallback"
        if not req.hashes:
            return least_loaded(candidates), "no_prefix"
        matched = self.index.matched_blocks(req.hashes, [r.name for r in candidates])
        total = len(req.hashes)

        def cost(r: Replica) -> tuple[float, float]:
            return (total - matched[r.name] + self.load_weight * r.outstanding, r.outstanding)

        best = min(candidates, key=cost)
        return best, "prefix_hit" if matched[best.name] else "no_prefix"


# The one registry of policies: the config check, the flags' choices and the gateway read it.
# Each entry makes its policy from (index, load_weight, imbalance_limit).
POLICIES: dict[str, Callable[[PrefixIndex, float, int], Policy]] = {
    "kv_aware": KVAware,
    "round_robin": lambda *_: RoundRobin(),
    "least_load": lambda *_: LeastLoad(),
    "power_of_two": lambda *_: PowerOfTwo(),
    "session": lambda *_: Session(),
}


def make_policy(name: str, index: PrefixIndex, load_weight: float = 8.0, imbalance_limit: int = 16) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name](index, load_weight, imbalance_limit)
