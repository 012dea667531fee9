"""A discrete-event simulator of a fleet of replicas behind one gateway. Arrivals are routed by the
gateway's own policies (kv_aware reads a prefix index fed by each replica's own KV events), each
replica steps its own scheduler, and every request comes out as the RequestRecord that `shoal
bench serve` would have measured, so the same report reads both."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from shoal.bench.report import RequestRecord, summarize
from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.replica import Health, Replica
from shoal.fleet.routing.policies import RouteRequest, make_policy
from shoal.protocol.block_hash import hash_blocks
from shoal.sim.profile import NodeProfile
from shoal.sim.replica import ReplicaShape, SimReplica
from shoal.sim.workload import SimRequest


@dataclass
class FleetShape:
    replicas: int = 1
    routing: str = "least_load"
    replica: ReplicaShape = field(default_factory=ReplicaShape)
    max_concurrency: int | None = None  # the clients' own cap on requests in flight


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float  # from the first arrival to the last answer
    replica_seconds: float  # replicas x the time they were up
    steps: int

    def summary(self, slo_ttft: float | None = None, slo_tpot: float | None = None) -> dict:
        s = summarize(self.records, self.duration_s, slo_ttft, slo_tpot)
        s["replica_seconds"] = self.replica_seconds
        s["steps"] = self.steps
        return s


class FleetSim:
    def __init__(self, profile: NodeProfile, shape: FleetShape):
        self.profile = profile
        self.shape = shape
        self.index = PrefixIndex()
        self.policy = make_policy(shape.routing, self.index)
        kv_events = shape.routing == "kv_aware"
        self.replicas = [
            SimReplica(f"sim-replica-{i}", profile, shape.replica, kv_events) for i in range(shape.replicas)
        ]
        # The gateway's view of each replica, as its policies read it.
        self.views = {
            r.name: Replica(r.name, "", state=Health.READY, kv_events=kv_events) for r in self.replicas
        }

    def _route(self, req: SimRequest) -> SimReplica:
        if len(self.replicas) == 1:
            return self.replicas[0]
        by_name = {r.name: r for r in self.replicas}
        for r in self.replicas:
            view = self.views[r.name]
            view.inflight = r.outstanding
            view.load = {"running": len(r.scheduler.running), "waiting": len(r.scheduler.waiting)}
        hashes = hash_blocks(req.prompt, self.profile.block_size) if self.shape.routing == "kv_aware" else []
        view, _reason = self.policy.choose(list(self.views.values()), RouteRequest(hashes=hashes))
        view.requests_total += 1
        if hashes:
            self.index.routed(view.name, hashes)
        return by_name[view.name]

    def _publish(self, replica: SimReplica) -> None:
        for ev in replica.pool.take_events():
            (self.index.stored if ev.kind == "stored" else self.index.removed)(replica.name, ev.block_hash)

    def run(self, requests: list[SimRequest]) -> SimResult:
        pending = deque(sorted(requests, key=lambda r: r.arrival))
        records: list[RequestRecord] = []
        steps: list[tuple[float, int, int]] = []  # (ends at, sequence, replica)
        seq = 0
        cap = self.shape.max_concurrency or math.inf
        in_flight = 0
        held: deque[SimRequest] = deque()  # arrived, waiting for the clients' cap
        waking: set[int] = set()  # idle replicas given work: their step starts at an event of its own
        now = 0.0
        first = pending[0].arrival if pending else 0.0

        def send(req: SimRequest, at: float) -> None:
            nonlocal seq, in_flight
            in_flight += 1
            rec = RequestRecord(start=at - first, input_len=req.prompt_len)
            records.append(rec)
            target = self._route(req)
            target.add(req, at, rec)
            i = self.replicas.index(target)
            if target.step_ends is None and i not in waking:
                # It starts a step once every arrival of this instant is in (arrivals go first).
                waking.add(i)
                seq += 1
                heapq.heappush(steps, (at, seq, i))

        while pending or steps or held:
            next_arrival = pending[0].arrival if pending else math.inf
            next_step = steps[0][0] if steps else math.inf
            if held and in_flight < cap:
                send(held.popleft(), now)
                continue
            if next_arrival <= next_step:
                if next_arrival == math.inf:
                    break  # held requests but nothing in flight to free a slot: cannot happen
                now = next_arrival
                held.append(pending.popleft())
                continue
            now, _, i = heapq.heappop(steps)
            replica = self.replicas[i]
            if i in waking:
                waking.discard(i)
            else:
                done = replica.end_step(now)
                in_flight -= len(done)
                if replica.pool.enable_events:
                    self._publish(replica)
            ends = replica.start_step(now)
            if ends is not None:
                seq += 1
                heapq.heappush(steps, (ends, seq, i))
        for rec in records:
            rec.chunk_times = [t - first for t in rec.chunk_times]
        duration = max(now - first, 1e-9)
        return SimResult(
            records,
            duration,
            duration * len(self.replicas),
            sum(r.steps for r in self.replicas),
        )
