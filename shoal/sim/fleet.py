"""A discrete-event simulator of a fleet of replicas behind one gateway. Arrivals are routed by the
gateway's own policies (kv_aware reads a prefix index fed by each replica's own KV events), each
replica steps its own scheduler, and every request comes out as the RequestRecord that `shoal
bench serve` would have measured, so the same report reads both."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from shoal.bench.report import RequestRecord, summarize
from shoal.fleet.config import GatewayConfig
from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.replica import Health, Replica
from shoal.fleet.routing.policies import RouteRequest, make_policy
from shoal.protocol.block_hash import hash_blocks
from shoal.sim.cores import SharedCores
from shoal.sim.drift import SpeedDrift
from shoal.sim.profile import NodeProfile
from shoal.sim.replica import ReplicaShape, SimReplica
from shoal.sim.scaling import OFF, STARTING, TICK_S, TTFT_WINDOW_S, Load, ScalingShape, SimPool
from shoal.sim.workload import SimRequest


@dataclass
class FleetShape:
    replicas: int = 1
    routing: str = "least_load"
    replica: ReplicaShape = field(default_factory=ReplicaShape)
    max_concurrency: int | None = None  # the clients' own cap on requests in flight
    # A disaggregated fleet: this many prefill and decode workers instead of `replicas`. As the
    # gateway does, a prompt with fewer uncached tokens (at its decode worker) than
    # disagg_min_prompt_tokens is prefilled where it decodes; the others are prefilled on a
    # prefill worker, whose K/V reaches the decode worker after what the profile measured a
    # handoff of its size to take over `kv_transport`.
    prefill: int = 0
    decode: int = 0
    disagg_min_prompt_tokens: int = 256
    kv_transport: str = "shm"
    # A remote prefill not done this long after the gateway sent it is given up on, and the decode
    # worker prefills the prompt itself (proxy/disagg.py): a fleet whose prefill queue grows past
    # it turns to its decode workers, whose streams then wait on whole prompts.
    prefill_timeout_s: float = GatewayConfig.prefill_timeout_s
    # An autoscaled pool (scaling.py) of up to scaling.max_replicas, instead of `replicas` fixed.
    scaling: ScalingShape | None = None
    # Requests that reach an idle replica at one instant share its first step, as an offline batch
    # does (LLM.generate adds them all, then steps). A server's front end hands its engine requests
    # one at a time, and an idle engine starts a step at the first: the others wait for the next.
    offline: bool = False
    # The replicas, the gateway and the clients all run on this many cores of one host (a fleet
    # tested on one machine), each replica pinned to the profile's threads: the front's work is
    # then taken from the replicas' steps (cores.py). None: the front has cores of its own.
    shared_cores: int | None = None
    # How often the gateway polls each replica's queue (/load); between polls it routes on its own
    # count of requests in flight and the queues as last polled.
    load_poll_interval_s: float = GatewayConfig.load_poll_interval_s

    def handoff_seconds(self, profile: NodeProfile, tokens: int) -> float:
        """From a prompt's last step on the prefill worker to its K/V at the decode worker: the
        prefill worker's CPU for the handoff (its engine packs the K/V before it answers; the
        write and the release, counted with it, are a few ms more than the way holds), then the
        pull, as the profile measured both (0: not measured)."""
        pull = profile.kv_transfer_seconds(tokens, self.kv_transport)
        return profile.kv_handoff_cpu_seconds(tokens, "prefill") + (0.0 if pull is None else pull)

    @property
    def roles(self) -> list[str]:
        if self.prefill:
            return ["prefill"] * self.prefill + ["decode"] * self.decode
        return ["both"] * (self.scaling.slots if self.scaling else self.replicas)


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float  # from the first arrival to the last answer
    replica_seconds: float  # replicas x the time they were up
    steps: int
    # Each role's steps' time as run over their price: what sharing cores and loading handed K/V
    # added ("prefill", "decode", or "both": whole replicas).
    step_stretch: dict[str, float] = field(default_factory=dict)
    # ... and by window of the drift it was given (none: not given), 1.0 where no step ran.
    window_stretch: dict[str, list[float]] = field(default_factory=dict)

    def summary(self, slo_ttft: float | None = None, slo_tpot: float | None = None) -> dict:
        s = summarize(self.records, self.duration_s, slo_ttft, slo_tpot)
        s["replica_seconds"] = self.replica_seconds
        s["steps"] = self.steps
        s["step_stretch"] = self.step_stretch
        s["window_stretch"] = self.window_stretch
        return s


class FleetSim:
    def __init__(
        self,
        profile: NodeProfile,
        shape: FleetShape,
        role_profiles: dict[str, NodeProfile] | None = None,
        drift: dict[str, SpeedDrift] | None = None,
    ):
        """`role_profiles`: the step costs of the workers of a role ("prefill", "decode", or "both":
        a whole replica) where they are not `profile`'s (another machine, or the same host at a
        speed of their own); `profile` holds the fleet's handoffs, start-up and front. `drift`: how
        the host's speed moved over the run being replayed, by role (none: it held still); the
        result then says how far the simulator stretched each window's steps itself."""
        if shape.prefill and not shape.decode:
            raise ValueError("a disaggregated fleet needs decode workers too")
        if shape.prefill and shape.scaling:
            raise ValueError("the simulator scales a pool of whole replicas, not a P/D fleet")
        self.profile = profile
        self.shape = shape
        self.index = PrefixIndex()
        self.policy = make_policy(shape.routing, self.index)
        # The gateway reads the prefix index to route by it, and to split a P/D fleet's prompts.
        kv_events = shape.routing == "kv_aware" or bool(shape.prefill)
        self.roles = shape.roles
        role_profiles = role_profiles or {}
        self.replicas = [
            SimReplica(
                f"sim-{role}-{i}" if shape.prefill else f"sim-replica-{i}",
                role_profiles.get(role, profile),
                shape.replica,
                kv_events,
            )
            for i, role in enumerate(self.roles)
        ]
        # The gateway's view of each replica, as its policies read it.
        self.views = {
            r.name: Replica(r.name, "", state=Health.READY, kv_events=kv_events, role=role)
            for r, role in zip(self.replicas, self.roles, strict=True)
        }
        self.by_name = {r.name: r for r in self.replicas}
        # A disaggregated request's prefill part, by its id: (the request, its record, when the
        # client sent it, its decode worker, its prefill worker).
        self.handing: dict[str, tuple[SimRequest, RequestRecord, float, int, int]] = {}
        self.pool = SimPool.of(shape.scaling, profile) if shape.scaling is not None else None
        self.cores = shared_cores(profile, shape.shared_cores)
        self.drift = drift or {}

    def _route(self, req: SimRequest, role: str, hashes: list[int]) -> tuple[SimReplica | None, int]:
        """The replica the gateway picks (None: no replica takes requests now), and how many of
        the prompt's leading blocks the index said it held before this request (dispatch's rule)."""
        candidates = [v for v in self.views.values() if v.role == role]
        if self.pool is not None:
            active = {self.replicas[i].name for i in self.pool.active}
            candidates = [v for v in candidates if v.name in active]
            if not candidates:
                return None, 0
        if len(candidates) == 1:
            view = candidates[0]
        else:
            for view in candidates:
                view.inflight = self.by_name[view.name].outstanding  # the gateway's own count
            view, _reason = self.policy.choose(candidates, RouteRequest(hashes=hashes))
        view.requests_total += 1
        cached = 0
        if hashes:
            cached = self.index.matched_blocks(hashes, [view.name])[view.name]
            self.index.routed(view.name, hashes)
        return self.by_name[view.name], cached

    def _poll_loads(self) -> None:
        """The gateway's poll of every replica's /load: its view of their queues until the next."""
        for r in self.replicas:
            view = self.views[r.name]
            view.load = {"running": len(r.scheduler.running), "waiting": len(r.scheduler.waiting)}

    def _stopped(self, i: int) -> None:
        """Replica i went down (idle): it comes back, if it does, with an empty cache."""
        old = self.replicas[i]
        fresh = SimReplica(old.name, old.profile, self.shape.replica, old.pool.enable_events)
        fresh.steps, fresh.shapes = old.steps, old.shapes
        fresh.priced_s, fresh.stepped_s = old.priced_s, old.stepped_s
        self.replicas[i] = self.by_name[old.name] = fresh
        self.index.reset(old.name)

    def _prefilled_remotely(self, hashes: list[int], cached: int) -> bool:
        """The gateway's rule (proxy/disagg.py): enough of the prompt is not cached where it decodes."""
        bs = self.profile.block_size
        return (
            bool(hashes)
            and cached < len(hashes)
            and (len(hashes) - cached) * bs >= self.shape.disagg_min_prompt_tokens
        )

    def _load(self, records: list[RequestRecord], now: float, first: float, last_arrival: float, queued: int):
        """What the autoscaler reads at a tick (see scaling.Load)."""
        since = now - first - TTFT_WINDOW_S
        recent = [r.ttft for r in records if r.ttft is not None and r.start + r.ttft >= since]
        return Load(
            inflight=[r.outstanding for r in self.replicas],
            waiting=[len(r.scheduler.waiting) for r in self.replicas],
            kv_usage=[r.pool.usage for r in self.replicas],
            queued=queued,
            ttft_p90=float(np.percentile(recent, 90)) if recent else None,
            idle_s=now - last_arrival,
        )

    def _publish(self, replica: SimReplica) -> None:
        for ev in replica.pool.take_events():
            (self.index.stored if ev.kind == "stored" else self.index.removed)(replica.name, ev.block_hash)

    def run(self, requests: list[SimRequest]) -> SimResult:
        pending = deque(sorted(requests, key=lambda r: r.arrival))
        records: list[RequestRecord] = []
        steps: list[tuple[float, int, int]] = []  # (ends at, sequence, replica)
        handoffs: list[tuple] = []  # (K/V arrives at, sequence, decode worker, request, record, sent)
        deadlines: list[tuple[float, int, str]] = []  # (a remote prefill's timeout, sequence, part)
        seq = 0
        cap = self.shape.max_concurrency or math.inf
        in_flight = 0
        held: deque[SimRequest] = deque()  # arrived, waiting for the clients' cap
        # When a client that finished a request may send its next, which reaches the engine then:
        # the end's way out and the next request's way in are one request's overhead together
        # (the overhead is counted once in each request's latencies, at its end).
        releases: list[float] = []
        # Offline: idle replicas given work, whose step starts at an event of its own.
        waking: set[int] = set()
        now = 0.0
        first = pending[0].arrival if pending else 0.0
        disaggregated = bool(self.shape.prefill)
        hashing = disaggregated or self.shape.routing == "kv_aware"
        pool = self.pool
        gateway: deque[tuple[SimRequest, RequestRecord, float]] = deque()  # waiting for a replica
        next_tick = first if pool is not None else math.inf
        next_poll = first
        last_arrival = first
        if pool is not None:
            pool.start(first)

        def stretch(at: float) -> float:
            if self.cores is None:
                return 1.0
            computing = 1 + sum(r.step_ends is not None for r in self.replicas)
            watched = len(self.replicas)
            if pool is not None:  # a replica starting up holds its cores too (imports, weights)
                computing += len(pool.with_state(STARTING))
                watched = len(self.replicas) - len(pool.with_state(OFF))
            return self.cores.stretch(at, computing, watched)

        # Each role's steps' (price, time) by drift window: the simulator's own stretch of each.
        windows: dict[str, dict[int, list[float]]] = {role: {} for role in self.drift}

        def start(i: int, at: float) -> float | None:
            replica, role = self.replicas[i], self.roles[i]
            drift = self.drift.get(role)
            if drift is None:
                return replica.start_step(at, stretch(at))
            priced, stepped = replica.priced_s, replica.stepped_s
            ends = replica.start_step(at, stretch(at), drift.at(at - first))
            took = windows[role].setdefault(int((at - first) // drift.window_s), [0.0, 0.0])
            took[0] += replica.priced_s - priced
            took[1] += replica.stepped_s - stepped
            return ends

        def wake(i: int, at: float) -> None:
            nonlocal seq
            replica = self.replicas[i]
            if replica.step_ends is not None or i in waking:
                return
            seq += 1
            if self.shape.offline:
                # It starts a step once every arrival of this instant is in (arrivals go first).
                waking.add(i)
                heapq.heappush(steps, (at, seq, i))
            elif (ends := start(i, at)) is not None:
                heapq.heappush(steps, (ends, seq, i))

        def send(
            req: SimRequest, at: float, rec: RequestRecord | None = None, sent: float | None = None
        ) -> None:
            nonlocal in_flight, seq
            if rec is None:
                in_flight += 1
                rec = RequestRecord(start=at - first, input_len=req.prompt_len)
                records.append(rec)
            hashes = hash_blocks(req.prompt, self.profile.block_size) if hashing else []
            target, cached = self._route(req, "decode" if disaggregated else "both", hashes)
            if target is None:  # the gateway holds it until a replica takes requests
                gateway.append((req, rec, at if sent is None else sent))
                return
            if disaggregated and self._prefilled_remotely(hashes, cached):
                decode = self.replicas.index(target)
                target.awaited += 1
                target, _ = self._route(req, "prefill", hashes)
                part = replace(req, id=f"{req.id}/prefill")
                target.add(part, at, RequestRecord(at - first, req.prompt_len), max_tokens=1)
                self.handing[part.id] = (req, rec, at, decode, self.replicas.index(target))
                seq += 1
                heapq.heappush(deadlines, (at + self.shape.prefill_timeout_s, seq, part.id))
            else:
                target.add(req, at, rec, sent=sent)
            wake(self.replicas.index(target), at)

        while pending or steps or held or handoffs or gateway:
            while deadlines and deadlines[0][2] not in self.handing:  # prefilled in time
                heapq.heappop(deadlines)
            next_arrival = pending[0].arrival if pending else math.inf
            # A timeout is the gateway handing the prompt to the decode worker: a handoff of its own.
            next_handoff = min(
                handoffs[0][0] if handoffs else math.inf, deadlines[0][0] if deadlines else math.inf
            )
            next_step = steps[0][0] if steps else math.inf
            # The replicas' queues as the gateway last polled them: what they held at the poll,
            # before the next event changes them.
            upcoming = (
                now if held and in_flight < cap else min(next_tick, next_arrival, next_handoff, next_step)
            )
            if releases:
                upcoming = min(upcoming, releases[0])
            if next_poll <= upcoming < math.inf:
                self._poll_loads()
                every = self.shape.load_poll_interval_s
                next_poll += every * (math.floor((upcoming - next_poll) / every) + 1)
            if held and in_flight < cap:
                send(held.popleft(), now)
                continue
            if releases and releases[0] <= min(next_tick, next_arrival, next_handoff, next_step):
                now = heapq.heappop(releases)
                in_flight -= 1
                continue
            if next_tick <= min(next_arrival, next_handoff, next_step):
                now, next_tick = next_tick, next_tick + TICK_S
                pool.tick(now, self._load(records, now, first, last_arrival, len(gateway)))
                for i in pool.take_stopped():
                    self._stopped(i)
                for _ in range(len(gateway)):
                    req, rec, sent = gateway.popleft()
                    send(req, now, rec, sent)
                continue
            if next_arrival <= next_step and next_arrival <= next_handoff:
                if next_arrival == math.inf:
                    break  # held requests but nothing in flight to free a slot: cannot happen
                now = last_arrival = next_arrival
                held.append(pending.popleft())
                continue
            if next_handoff <= next_step:
                if deadlines and deadlines[0][0] == next_handoff:
                    now, _, part = heapq.heappop(deadlines)
                    req, rec, sent, d, p = self.handing.pop(part)
                    self.replicas[p].abandon(part)
                    handed = 0  # the decode worker computes the prompt
                else:
                    now, _, d, req, rec, sent = heapq.heappop(handoffs)
                    handed = req.prompt_len
                self.replicas[d].awaited -= 1
                self.replicas[d].add(req, now, rec, sent=sent, external_tokens=handed)
                wake(d, now)
                continue
            now, _, i = heapq.heappop(steps)
            replica = self.replicas[i]
            if i in waking:
                waking.discard(i)
            else:
                done = replica.end_step(now)
                if self.cores is not None:
                    self.cores.streamed(now, i, replica.last_sampled)
                packing = 0.0  # a prefill worker's CPU for the handoffs of this step's prompts
                if self.roles[i] == "prefill":
                    for t in done:  # its K/V goes on to the decode worker
                        req, rec, sent, d, _ = self.handing.pop(t.request_id)
                        seq += 1
                        ready = now + self.shape.handoff_seconds(self.profile, req.prompt_len)
                        heapq.heappush(handoffs, (ready, seq, d, req, rec, sent))
                        packing += self.profile.kv_handoff_cpu_seconds(req.prompt_len, "prefill")
                elif cap < math.inf:  # uncapped: nobody waits for a slot
                    for _ in done:
                        heapq.heappush(releases, now + replica.overhead)
                if replica.pool.enable_events:
                    self._publish(replica)
                if packing:  # its engine packs them before its next step
                    waking.add(i)
                    seq += 1
                    heapq.heappush(steps, (now + packing, seq, i))
                    continue
            ends = start(i, now)
            if ends is not None:
                seq += 1
                heapq.heappush(steps, (ends, seq, i))
        for rec in records:
            rec.chunk_times = [t - first for t in rec.chunk_times]
        duration = max(now - first, 1e-9)
        up = pool.replica_seconds(now) if pool is not None else duration * len(self.replicas)
        stretched = {}
        for role in set(self.roles):
            mine = [r for r, of in zip(self.replicas, self.roles, strict=True) if of == role]
            priced = sum(r.priced_s for r in mine)
            stretched[role] = sum(r.stepped_s for r in mine) / priced if priced else 1.0
        by_window = {
            role: [w[k][1] / w[k][0] if k in w and w[k][0] else 1.0 for k in range(max(w) + 1)]
            for role, w in windows.items()
            if w
        }
        return SimResult(records, duration, up, sum(r.steps for r in self.replicas), stretched, by_window)


def shared_cores(profile: NodeProfile, cores: int | None) -> SharedCores | None:
    """The rule for a fleet on `cores` shared cores (None: not shared), from what the profile's
    calibration measured of its front."""
    if cores is None:
        return None
    front = profile.serving.get("front_cpu_s_per_token")
    if front is None:
        raise ValueError(
            "shared cores need the front's CPU a token, which this profile lacks: "
            "take it with `shoal profile --through-gateway`"
        )
    calibrated_on = int(profile.serving.get("cores", cores))
    threads = profile.num_threads or calibrated_on
    idle = profile.serving.get("gateway_idle_cpu_s_per_s", 0.0)  # older profiles: in `front`
    return SharedCores(cores, threads, front, max(0, calibrated_on - threads), idle)
