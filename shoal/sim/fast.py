"""The simulator at fleet scale: thousands of replicas, millions of requests, in seconds. Each
replica is a FastReplica (fast_replica.py: the scheduler's rules in aggregate, decode stretches as
one event); routing is the gateway's policies by the same rules, over loads kept in a heap. Its
agreement with the exact simulator (fleet.py, the engine's own scheduler) is checked in the
tests; `shoal sim --mode fast` runs it."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from shoal.bench.report import PERCENTILES, CompletedRequests, summary_of
from shoal.sim.fast_replica import ITL_BUCKETS, FastReplica, RunArrays
from shoal.sim.fleet import FleetShape
from shoal.sim.profile import NodeProfile
from shoal.sim.replica import request_overhead
from shoal.sim.workload import SimRequest, paused_gc

KV_CANDIDATES = 16  # holders of a prefix that kv_aware weighs against the least loaded replica


class FastFleet:
    """N fast replicas behind a routing policy: round_robin, power_of_two, least_load, kv_aware."""

    def __init__(self, profile: NodeProfile, shape: FleetShape, seed: int = 0, load_weight: float = 8.0):
        if shape.prefill:
            raise ValueError("the fast simulator has no P/D split; the exact one (FleetSim) has")
        self.profile = profile
        self.shape = shape
        self.replicas: list[FastReplica] = []
        self.rng = random.Random(seed)
        self.load_weight = load_weight
        self.holders: dict[int, dict[int, None]] = {}  # prefix id -> replicas holding it, latest last
        self._rr = 0
        self.loads: list[int] = [0] * shape.replicas  # each replica's requests in its hands
        self._loads: list[tuple[int, int]] = [(0, i) for i in range(shape.replicas)]  # lazy heap

    def run(self, requests: list[SimRequest]) -> FastResult:
        with paused_gc():
            return self._run(requests)

    def _run(self, requests: list[SimRequest]) -> FastResult:
        reqs = sorted(requests, key=lambda r: r.arrival)
        out = RunArrays(len(reqs))
        r = self.shape.replica
        holders = self.holders  # every replica caches prefixes; kv_aware routing also reads them
        self.loads = [0] * self.shape.replicas
        self.replicas = [
            FastReplica(
                i,
                self.profile,
                r.max_num_seqs,
                r.max_num_batched_tokens,
                holders,
                out,
                request_overhead(self.profile, r),
                self.loads,
            )
            for i in range(self.shape.replicas)
        ]
        first = reqs[0].arrival if reqs else 0.0
        events: list[tuple[float, int, int, int]] = []  # (time, sequence, replica, its version)
        seq = 0
        cap = self.shape.max_concurrency or math.inf
        held: deque[int] = deque()
        next_req = 0
        now = first
        bs = self.profile.block_size

        def push(rep: FastReplica, at: float) -> None:
            nonlocal seq
            rep.version += 1
            rep.busy_until = at
            seq += 1
            heapq.heappush(events, (at, seq, rep.index, rep.version))

        def send(i: int, at: float) -> None:
            req = reqs[i]
            out.start[i] = at - first
            out.input_len[i] = req.prompt_len
            blocks = -(-req.prompt_len // bs)
            target = self.replicas[self.route(req.prefix_id, req.prefix_len // bs, blocks)]
            target.add(i, req, at)
            self._loaded(target.index)
            if target.busy_until is None:
                push(target, at)  # wakes once every arrival of this instant is in
                target.waking = True
            elif target.segment is not None:
                ends = target.cut(at)
                if ends is not None:
                    push(target, ends)

        in_flight = 0
        loads = self.loads
        while next_req < len(reqs) or events or held:
            if held and in_flight < cap:
                in_flight += 1
                send(held.popleft(), now)
                continue
            t_arrival = reqs[next_req].arrival if next_req < len(reqs) else math.inf
            t_event = events[0][0] if events else math.inf
            if t_arrival <= t_event:
                if t_arrival == math.inf:
                    break
                now = t_arrival
                held.append(next_req)
                next_req += 1
                continue
            now, _, i, version = heapq.heappop(events)
            rep = self.replicas[i]
            if version != rep.version:
                continue  # replaced by a cut
            if rep.waking:
                rep.waking = False
            else:
                before = loads[i]
                rep.finish(now)
                if loads[i] != before:
                    in_flight -= before - loads[i]
                    self._loaded(i)
            ends = rep.plan(now)
            if ends is None:
                rep.busy_until = None
            else:
                push(rep, ends)
        duration = max(now - first, 1e-9)
        steps = sum(rep.steps for rep in self.replicas)
        return FastResult(out, duration, duration * len(self.replicas), steps)

    # --- routing ----------------------------------------------------------------------------

    def _least_loaded(self) -> int:
        """The least loaded replica, the lowest index of those: every change of a replica's load
        pushes an entry, so the stale ones on top are dropped."""
        heap, loads = self._loads, self.loads
        while True:
            load, i = heap[0]
            if load == loads[i]:
                return i
            heapq.heappop(heap)

    def _loaded(self, i: int) -> None:
        heap, loads = self._loads, self.loads
        heapq.heappush(heap, (loads[i], i))
        if len(heap) > 8 * len(loads):  # stale entries of loads long gone: start afresh
            heap[:] = [(load, j) for j, load in enumerate(loads)]
            heapq.heapify(heap)

    def route(self, prefix_id: int | None, prefix_blocks: int, prompt_blocks: int) -> int:
        n, policy = len(self.replicas), self.shape.routing
        if n == 1:
            return 0
        if policy == "round_robin":
            self._rr += 1
            return self._rr % n
        if policy == "power_of_two":
            a, b = self.rng.sample(range(n), 2)
            return a if self.loads[a] <= self.loads[b] else b
        best = self._least_loaded()
        if policy != "kv_aware" or prefix_id is None:
            return best

        # kv_aware's cost: the prompt blocks a replica lacks + load_weight x its load. A replica
        # without the prefix is best at its least loaded, so only holders compete with that one;
        # of a prefix held widely, the latest few (a gateway over thousands of replicas that
        # scored each for every request would be its own bottleneck).
        holders = self.holders.get(prefix_id)
        if not holders:
            return best
        loads, w = self.loads, self.load_weight
        choice, low = best, prompt_blocks + w * loads[best]
        if best in holders:
            low -= prefix_blocks
        lacking = prompt_blocks - prefix_blocks
        for i in itertools.islice(reversed(holders), KV_CANDIDATES):
            c = lacking + w * loads[i]
            if c < low:
                choice, low = i, c
        return choice


@dataclass
class FastResult:
    out: RunArrays
    duration_s: float
    replica_seconds: float
    steps: int

    def summary(self, slo_ttft: float | None = None, slo_tpot: float | None = None) -> dict:
        o = self.out.arrays()
        ok = ~np.isnan(o.e2e)
        done = CompletedRequests(o.input_len[ok], o.output_tokens[ok], o.ttft[ok], o.e2e[ok])
        itl = histogram_stats(o.itl_counts())
        s = summary_of(done, len(o.e2e), {}, self.duration_s, itl, slo_ttft, slo_tpot)
        s["replica_seconds"] = self.replica_seconds
        s["steps"] = self.steps
        return s


def histogram_stats(counts: np.ndarray) -> dict:
    total = counts.sum()
    if not total:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    mids = np.concatenate([[ITL_BUCKETS[0]], np.sqrt(ITL_BUCKETS[1:] * ITL_BUCKETS[:-1]), [ITL_BUCKETS[-1]]])
    cum = np.cumsum(counts) / total
    out = {"mean": float((counts * mids).sum() / total)}
    for p in PERCENTILES:
        out[f"p{p}"] = float(mids[int(np.searchsorted(cum, p / 100))])
    return out
