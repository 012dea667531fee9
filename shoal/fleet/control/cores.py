"""Sharing one host's cores among the replicas a launcher runs there.

A replica left to itself takes every core: torch, OpenMP (which the C kernels share with torch),
MKL and the tokenizers' pool each size themselves from the machine. Two such replicas on two cores
run four compute threads that preempt each other at every barrier of every layer; on this 2-core
host that served 45 tok/s where one replica alone served 398 (benchmarks/fleet_cores.py). So, as
Ray's `num_cpus` does when it places an actor, each replica here gets a number of cores, runs that
many compute threads, and is pinned to those cores (CPU affinity, set in the child before it
execs, so every thread it starts, and every tensor-parallel rank it spawns, inherits it).

A replica slot reserves its cores whatever its state: a warm standby holds them while it waits,
so that its promotion is instant and lands on cores nobody else computes on. The per-replica
figure defaults to the host's cores over the replicas the fleet may run at once (every pool's
maximum plus its standbys). When more replicas run than the cores hold at that figure (a host
smaller than the fleet, or a rolling update's surge replica), `when_full` says what happens:
"share" places the replica on the least-shared cores (each core then carries at most
ceil(replicas / cores) of them, shown in /replicas), "wait" starts no further replica until cores
are free (the surge replica of a rolling update still starts, on shared cores, for its short life).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

WHEN_FULL = ("share", "wait")
# Every runtime in a replica that sizes a thread pool from the machine unless told. torch reads
# OMP_NUM_THREADS for its intra-op pool (the C kernels' OpenMP regions share it); the tokenizers'
# Rust pool reads RAYON_NUM_THREADS. torch's inter-op pool is never used by shoal (no jit.fork),
# so its size, which no variable sets, costs nothing.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")


@dataclass
class CoresConfig:
    """How a local fleet shares this host's cores (`[cores]` in fleet.toml)."""

    # Cores, and compute threads, each replica gets; None: the host's cores over the replicas the
    # fleet may run at once, at least 1. A replica whose flags say `--threads N` gets N.
    per_replica: int | None = None
    cpus: list[int] | None = None  # the cores replicas run on; None: those this process may use
    # Cores kept out of the replicas' share for the gateway (which relays every token and tokenizes
    # prompts); None: 1 on a host of 8 cores or more, else none (the gateway then floats).
    gateway: int | None = None
    when_full: str = "share"  # more replicas than cores: "share" the least-shared cores, or "wait"

    def check(self) -> None:
        if self.when_full not in WHEN_FULL:
            raise ValueError(f"cores.when_full must be one of {', '.join(WHEN_FULL)}, not {self.when_full!r}")
        if self.per_replica is not None and self.per_replica < 1:
            raise ValueError("cores.per_replica must be at least 1")
        if self.gateway is not None and self.gateway < 0:
            raise ValueError("cores.gateway must be at least 0")


def host_cpus() -> list[int]:
    """The cores this process may run on (its affinity, which a container or taskset narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def threads_flag(args: list[str]) -> int | None:
    """N, when replica flags say `--threads N` (or `--threads=N`): the operator's own figure."""
    for i, a in enumerate(args):
        value = a.split("=", 1)[1] if a.startswith("--threads=") else None
        if a == "--threads" and i + 1 < len(args):
            value = args[i + 1]
        if value is not None:
            try:
                return max(1, int(value))
            except ValueError:
                return None  # `shoal serve` will say what is wrong with it
    return None


def thread_env(threads: int, shared: bool = False) -> dict[str, str]:
    """The environment that holds a process's compute threads to `threads`. On cores it shares,
    OpenMP threads that wait at a barrier sleep instead of spinning: a spinning thread takes the
    core from the replica beside it, and a replica of two threads whose partner is descheduled
    spins for most of its turn (on this 2-core host under others' load, a lone 2-thread `shoal
    serve` fell from 128 tok/s to 3 that way; benchmarks/fleet_cores.py)."""
    env = {var: str(threads) for var in THREAD_VARS}
    if shared:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def planned_replicas(models) -> int:
    """Replicas a fleet of these ModelConfigs may run at once: each pool's most, and its standbys."""
    return max(
        1, sum(hi + (m.warm_standby if role == "both" else 0) for m in models for role, _, hi in m.pools())
    )


class CoreLease:
    """The cores one replica process holds, until it exits."""

    def __init__(self, allocator: CoreAllocator, cpus: list[int], threads: int, shared: bool = False):
        self.cpus = cpus
        self.threads = threads
        self.shared = shared  # another replica holds one of its cores too
        self._allocator = allocator
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._allocator._free(self)


class CoreAllocator:
    """Hands each replica process its cores: free ones first, then the least shared."""

    def __init__(self, cpus: list[int], per_replica: int, when_full: str = "share"):
        if not cpus:
            raise ValueError("no cores to run replicas on")
        self.cpus = list(cpus)
        self.per_replica = max(1, min(per_replica, len(self.cpus)))
        self.when_full = when_full
        self.holders: dict[int, int] = dict.fromkeys(self.cpus, 0)  # core -> replicas pinned to it
        self.leases: list[CoreLease] = []

    @classmethod
    def for_fleet(cls, config: CoresConfig, replicas: int, cpus: list[int] | None = None) -> CoreAllocator:
        """The allocator of a fleet that may run `replicas` at once on this host."""
        config.check()
        cpus = list(config.cpus or cpus or host_cpus())
        keep = config.gateway if config.gateway is not None else (1 if len(cpus) >= 8 else 0)
        if 0 < keep < len(cpus):
            cpus = cpus[keep:]  # the first ones, where the gateway (this process) starts out
        per = config.per_replica or max(1, len(cpus) // max(1, replicas))
        allocator = cls(cpus, per, config.when_full)
        fit = allocator.capacity
        how = f"{allocator.per_replica} core(s) and compute thread(s) each"
        if replicas > fit:
            if config.when_full == "share":
                sharing = math.ceil(replicas * allocator.per_replica / len(cpus))
                how += f"; past {fit} they share cores (up to {sharing} a core)"
            else:
                how += f"; past {fit}, a replica waits for cores"
        level = logging.WARNING if replicas > fit else logging.INFO
        log.log(
            level, "cores: up to %d replicas on %d cores (%s): %s", replicas, len(cpus), _ranges(cpus), how
        )
        return allocator

    @property
    def capacity(self) -> int:
        """Replicas that fit without sharing a core."""
        return len(self.cpus) // self.per_replica

    def has_room(self, threads: int | None = None) -> bool:
        """Whether a replica may start now: always when sharing, else when its cores are free."""
        free = sum(1 for c in self.cpus if self.holders[c] == 0)
        return self.when_full == "share" or free >= (threads or self.per_replica)

    def acquire(self, threads: int | None = None) -> CoreLease:
        """Cores for one replica of `threads` compute threads (default: the per-replica figure):
        the least-held cores, neighbours first (they share caches)."""
        n = max(1, min(threads or self.per_replica, len(self.cpus)))
        order = sorted(self.cpus, key=lambda c: (self.holders[c], self.cpus.index(c)))
        least = self.holders[order[n - 1]]
        # Among the cores as little held as the n-th, take a contiguous run where there is one.
        pool = [c for c in self.cpus if self.holders[c] <= least]
        chosen = _contiguous(pool, n, self.holders) or order[:n]
        shared = any(self.holders[c] for c in chosen)
        for c in chosen:
            self.holders[c] += 1
        lease = CoreLease(self, sorted(chosen), n, shared)
        self.leases.append(lease)
        return lease

    def hold(self, cpus: list[int]) -> CoreLease:
        """A lease of the given cores: those of a replica already pinned to them (adopted)."""
        chosen = sorted(c for c in cpus if c in self.holders)
        shared = any(self.holders[c] for c in chosen)
        for c in chosen:
            self.holders[c] += 1
        lease = CoreLease(self, chosen, len(chosen), shared)
        self.leases.append(lease)
        return lease

    def _free(self, lease: CoreLease) -> None:
        for c in lease.cpus:
            self.holders[c] -= 1
        self.leases.remove(lease)


def _contiguous(pool: list[int], n: int, holders: dict[int, int]) -> list[int] | None:
    """The least-held run of n consecutive core ids in `pool`, if there is one."""
    runs = [pool[i : i + n] for i in range(len(pool) - n + 1) if pool[i + n - 1] - pool[i] == n - 1]
    return min(runs, key=lambda run: sum(holders[c] for c in run)) if runs else None


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(parts)
