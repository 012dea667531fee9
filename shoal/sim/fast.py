"""The simulator at fleet scale: thousands of replicas, millions of requests, in seconds. Each
replica is a FastReplica (fast_replica.py: the scheduler's rules in aggregate, decode stretches as
one event); routing is the gateway's policies by the same rules (fast_routing.py), and a P/D
fleet's split is the gateway's rule, as the exact simulator has it. Its agreement with the exact
simulator (fleet.py, the engine's own scheduler) is checked in the tests; `shoal sim --mode fast`
runs it."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from shoal.bench.report import PERCENTILES, CompletedRequests, summary_of
from shoal.sim.fast_replica import ITL_BUCKETS, FastReplica, RunArrays
from shoal.sim.fast_routing import FastRouter
from shoal.sim.fleet import FleetShape
from shoal.sim.profile import NodeProfile
from shoal.sim.replica import request_overhead
from shoal.sim.scaling import TICK_S, TTFT_WINDOW_S, Load, SimPool
from shoal.sim.workload import SimRequest, paused_gc


class FastFleet:
    """N fast replicas behind a routing policy (round_robin, power_of_two, least_load, kv_aware),
    an autoscaled pool of them (scaling.py's rules, as the exact simulator has them), or a P/D
    fleet of prefill and decode workers behind the gateway's rule."""

    def __init__(self, profile: NodeProfile, shape: FleetShape, seed: int = 0, load_weight: float = 8.0):
        if shape.prefill and not shape.decode:
            raise ValueError("a disaggregated fleet needs decode workers too")
        if shape.prefill and shape.scaling:
            raise ValueError("the simulator scales a pool of whole replicas, not a P/D fleet")
        if shape.shared_cores is not None:
            # A fleet of a few replicas on one host: the exact simulator is quick enough for it.
            raise ValueError("the fast simulator has no model of shared cores; use the exact one")
        if shape.replica.noisy:
            raise ValueError("the fast simulator prices each step as its profile does; use the exact one")
        self.profile = profile
        self.shape = shape
        self.roles = shape.roles
        self.replicas: list[FastReplica] = []
        self.rng = random.Random(seed)
        self.load_weight = load_weight
        # Prefix id -> the replicas of a role holding it, latest last: every replica caches
        # prefixes, and kv_aware routing reads them.
        self.holders: dict[str, dict[int, dict[int, None]]] = {role: {} for role in set(self.roles)}
        self.loads: list[int] = [0] * len(self.roles)  # each replica's requests in its hands
        self.routers: dict[str, FastRouter] = {}
        self.pool = SimPool.of(shape.scaling, profile) if shape.scaling is not None else None

    def run(self, requests: list[SimRequest]) -> FastResult:
        with paused_gc():
            return self._run(requests)

    def _start(self, out: RunArrays) -> None:
        r = self.shape.replica
        roles = self.roles
        self.loads = loads = [0] * len(roles)
        overhead = request_overhead(self.profile, r)
        self.replicas = [
            FastReplica(
                i,
                self.profile,
                r.max_num_seqs,
                r.max_num_batched_tokens,
                self.holders[role],
                out,
                overhead,
                loads,
            )
            for i, role in enumerate(roles)
        ]
        self.routers = {
            role: FastRouter(
                self.shape.routing,
                [i for i, r in enumerate(roles) if r == role],
                loads,
                self.holders[role],
                self.rng,
                self.load_weight,
            )
            for role in self.holders
        }

    def _prefilled_remotely(self, req: SimRequest, decode: FastReplica) -> bool:
        """The gateway's rule (proxy/disagg.py): enough of the prompt's whole blocks are not
        cached where it decodes."""
        bs = self.profile.block_size
        blocks = req.prompt_len // bs
        cached = min(decode.cached_prefix_blocks(req.prefix_id), req.prefix_len // bs)
        return cached < blocks and (blocks - cached) * bs >= self.shape.disagg_min_prompt_tokens

    def _run(self, requests: list[SimRequest]) -> FastResult:
        reqs = sorted(requests, key=lambda r: r.arrival)
        out = RunArrays(len(reqs))
        self._start(out)
        disaggregated = bool(self.shape.prefill)
        front = self.routers["decode" if disaggregated else "both"]
        router_of = [self.routers[role] for role in self.roles]
        prefill_of = [role == "prefill" for role in self.roles]
        loads = self.loads
        first = reqs[0].arrival if reqs else 0.0
        events: list[tuple[float, int, int, int]] = []  # (time, sequence, replica, its version)
        handoffs: list[tuple[float, int, int, int]] = []  # (K/V arrives, sequence, request, decode worker)
        # Remote prefills not yet handed on: the request's prefill and decode workers; and when the
        # gateway gives up on each (FleetShape.prefill_timeout_s).
        parts: dict[int, tuple[int, int]] = {}
        deadlines: list[tuple[float, int, int]] = []  # (timeout, sequence, request)
        seq = 0
        cap = self.shape.max_concurrency or math.inf
        held: deque[int] = deque()
        next_req = 0
        now = first
        bs = self.profile.block_size
        pool = self.pool
        gateway: deque[tuple[int, float]] = deque()  # (request, sent): waiting for a replica
        next_tick = first if pool is not None else math.inf
        last_arrival = first
        if pool is not None:
            pool.start(first)
            front.serve(pool.active)
            out.first_tokens = deque()

        def push(rep: FastReplica, at: float) -> None:
            nonlocal seq
            rep.version += 1
            rep.busy_until = at
            seq += 1
            heapq.heappush(events, (at, seq, rep.index, rep.version))

        def given(target: FastReplica, at: float) -> None:
            """target was given a request at `at`."""
            router_of[target.index].loaded(target.index)
            if target.busy_until is None:
                if self.shape.offline:  # see FleetShape.offline
                    push(target, at)  # wakes once every arrival of this instant is in
                    target.waking = True
                elif (ends := target.plan(at)) is not None:
                    push(target, ends)
            elif target.segment is not None:
                ends = target.cut(at)
                if ends is not None:
                    push(target, ends)

        def send(i: int, at: float, sent: float | None = None) -> None:
            nonlocal seq
            req = reqs[i]
            sent = at if sent is None else sent
            if not front.members:  # the gateway holds it until a replica takes requests
                gateway.append((i, sent))
                return
            out.start[i] = sent - first
            out.input_len[i] = req.prompt_len
            blocks = -(-req.prompt_len // bs)
            prefix_blocks = req.prefix_len // bs
            target = self.replicas[front.route(req.prefix_id, prefix_blocks, blocks)]
            if disaggregated and self._prefilled_remotely(req, target):
                decode = target.index
                loads[decode] += 1  # in flight to it from now, as the gateway counts it
                front.loaded(decode)
                target = self.replicas[self.routers["prefill"].route(req.prefix_id, prefix_blocks, blocks)]
                target.add(i, req, sent, handoff_to=decode)
                parts[i] = (target.index, decode)
                seq += 1
                heapq.heappush(deadlines, (at + self.shape.prefill_timeout_s, seq, i))
            else:
                target.add(i, req, sent)
            given(target, at)

        in_flight = 0
        releases: list[float] = []  # when a client may send again (see FleetSim.run)
        while next_req < len(reqs) or events or held or handoffs or gateway:
            if held and in_flight < cap:
                in_flight += 1
                send(held.popleft(), now)
                continue
            t_arrival = reqs[next_req].arrival if next_req < len(reqs) else math.inf
            t_event = events[0][0] if events else math.inf
            while deadlines and deadlines[0][2] not in parts:  # prefilled in time
                heapq.heappop(deadlines)
            # A timeout is the gateway handing the prompt to the decode worker: a handoff of its own.
            t_handoff = min(
                handoffs[0][0] if handoffs else math.inf, deadlines[0][0] if deadlines else math.inf
            )
            if releases and releases[0] <= min(next_tick, t_arrival, t_event, t_handoff):
                now = heapq.heappop(releases)
                in_flight -= 1
                continue
            if next_tick <= min(t_arrival, t_event, t_handoff):
                now, next_tick = next_tick, next_tick + TICK_S
                active = pool.active
                pool.tick(now, self._load(now, last_arrival, len(gateway), out.first_tokens))
                for i in pool.take_stopped():
                    self.replicas[i].drop_cache()
                if pool.active != active:
                    front.serve(pool.active)
                for _ in range(len(gateway)):
                    i, sent = gateway.popleft()
                    send(i, now, sent)
                continue
            if t_arrival <= t_event and t_arrival <= t_handoff:
                if t_arrival == math.inf:
                    break
                now = last_arrival = t_arrival
                held.append(next_req)
                next_req += 1
                continue
            if t_handoff <= t_event:  # a prompt's K/V reaches its decode worker, or its timeout
                if deadlines and deadlines[0][0] == t_handoff:
                    now, _, j = heapq.heappop(deadlines)
                    p, d = parts.pop(j)
                    self.replicas[p].abandon(j)
                    router_of[p].loaded(p)
                    external = 0  # the decode worker computes the prompt
                else:
                    now, _, j, d = heapq.heappop(handoffs)
                    external = reqs[j].prompt_len - 1
                target = self.replicas[d]
                loads[d] -= 1  # counted since it was routed: add() counts it again
                target.add(j, reqs[j], out.start[j] + first, external=external)
                given(target, now)
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
                    if not prefill_of[i] and cap < math.inf:  # uncapped: nobody waits for a slot
                        for _ in range(before - loads[i]):
                            heapq.heappush(releases, now + rep.overhead)
                    router_of[i].loaded(i)
                packing = 0.0  # its CPU for the handoffs of this step's prompts
                for f in rep.handed:  # its K/V goes on to the decode worker
                    del parts[f.index]
                    seq += 1
                    ready = now + self.shape.handoff_seconds(self.profile, f.prompt_len)
                    heapq.heappush(handoffs, (ready, seq, f.index, f.handoff_to))
                    packing += self.profile.kv_handoff_cpu_seconds(f.prompt_len, "prefill")
                rep.handed.clear()
                if packing:  # its engine packs them before its next step
                    push(rep, now + packing)
                    rep.waking = True
                    continue
            ends = rep.plan(now)
            if ends is None:
                rep.busy_until = None
            else:
                push(rep, ends)
        duration = max(now - first, 1e-9)
        steps = sum(rep.steps for rep in self.replicas)
        up = pool.replica_seconds(now) if pool is not None else duration * len(self.replicas)
        return FastResult(out, duration, up, steps)

    def _load(self, now: float, last_arrival: float, queued: int, first_tokens: deque) -> Load:
        """What the autoscaler reads at a tick (see scaling.Load); `first_tokens`: (when, TTFT)
        of the run's first tokens so far, of which those older than the window are dropped."""
        while first_tokens and first_tokens[0][0] < now - TTFT_WINDOW_S:
            first_tokens.popleft()
        recent = [ttft for _, ttft in first_tokens]
        return Load(
            inflight=self.loads,
            waiting=[len(r.waiting) for r in self.replicas],
            kv_usage=[r.kv_usage for r in self.replicas],
            queued=queued,
            ttft_p90=float(np.percentile(recent, 90)) if recent else None,
            idle_s=now - last_arrival,
        )


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
