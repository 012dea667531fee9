"""`shoal plan`: the cheapest fleet shape that meets an SLO at a given load, from a node profile.

For each replica shape (max batch, prefill chunk) it finds the fewest replicas that meet the SLO:
the arithmetic gives a floor (what one replica can carry at all), and the simulator checks one
replica at its share of the load (rate / N: a gateway that sends each request where there is room
does no worse than that random split), stepping N up until the percentiles hold. The shapes
closest to the cheapest are then simulated whole, N replicas behind the routing policy, and N
brought down to the fewest that still hold. Those shapes are also tried as P/D fleets, sized as
DistServe sizes them, each phase on its own: the fewest prefill workers that hold the TTFT bound
with decode workers to spare, then the fewest decode workers that hold the whole SLO behind them.
All of it on the fast simulator (fast.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from shoal.engine.step_shape import StepShape
from shoal.fleet.control.autoscaler import AutoscaleConfig
from shoal.sim.fast import FastFleet
from shoal.sim.fleet import FleetShape
from shoal.sim.profile import NodeProfile
from shoal.sim.replica import ReplicaShape
from shoal.sim.scaling import ScalingShape
from shoal.sim.workload import WorkloadSpec


@dataclass
class SLO:
    ttft_p99_s: float = 2.0
    itl_p99_s: float | None = None

    def met(self, summary: dict) -> bool:
        if summary["failed"]:
            return False
        ttft, itl = summary["ttft_s"]["p99"], summary["itl_s"]["p99"]
        if ttft is None or ttft > self.ttft_p99_s:
            return False
        return self.itl_p99_s is None or itl is None or itl <= self.itl_p99_s


@dataclass
class PlanConfig:
    slo: SLO = field(default_factory=SLO)
    batch_sizes: tuple[int, ...] = (16, 32, 64, 128, 256)
    chunk_sizes: tuple[int, ...] = (512, 2048)
    requests_per_check: int = 2000  # simulated for one replica at its share of the load
    requests_per_replica: int = 200  # a whole fleet's simulation: this many a replica...
    max_fleet_requests: int = 50_000  # ...up to this many
    refine_within: float = 1.25  # shapes within this factor of the cheapest split are simulated whole
    routing: str = "least_load"
    max_replicas: int = 100_000
    disaggregated: bool = True  # also size P/D fleets of the shapes near the cheapest
    disagg_min_prompt_tokens: int = 256
    # Prefill and decode workers of a fleet this size sit on different hosts: the handoff is TCP's.
    kv_transport: str = "tcp"


@dataclass
class Candidate:
    shape: ReplicaShape
    replicas: int | None  # None: no number of replicas meets the SLO
    floor: int  # the arithmetic's least number of replicas
    summary: dict | None = None  # the simulation that decided `replicas`
    split: int | None = None  # replicas by the split (one replica at rate / N), before refining
    prefill: int = 0  # a P/D fleet: of `replicas`, this many prefill workers (the rest decode)

    @property
    def decode(self) -> int:
        return (self.replicas or 0) - self.prefill

    def fleet(self, cfg: PlanConfig) -> FleetShape:
        if self.prefill:
            return pd_fleet(self.shape, self.prefill, self.decode, cfg)
        return FleetShape(self.replicas, cfg.routing, self.shape)

    def describe(self) -> str:
        s = self.shape
        shape = f"batch {s.max_num_seqs}, chunk {s.max_num_batched_tokens}"
        if self.prefill:
            return f"{self.replicas} workers ({self.prefill} prefill + {self.decode} decode) of {shape}"
        return f"{self.replicas} replicas of {shape}"

    def row(self) -> str:
        s = self.shape
        head = f"batch {s.max_num_seqs:>4}  chunk {s.max_num_batched_tokens:>5}  floor {self.floor:>6}"
        if self.replicas is None:
            return f"{head}  split      -  (the SLO is out of reach of this shape)"
        m = self.summary
        figures = (
            f"TTFT p99 {1e3 * m['ttft_s']['p99']:8.1f} ms  ITL p99 {1e3 * (m['itl_s']['p99'] or 0):7.1f} ms"
        )
        if self.prefill:
            return f"{head}  P/D {self.prefill:>6} + {self.decode:<6} = {self.replicas:>6}  {figures}"
        whole = f"{self.replicas:>6}" if self.replicas != self.split else "     ="
        return f"{head}  split {self.split:>6}  whole {whole}  {figures}"


def prompt_seconds(profile: NodeProfile, shape: ReplicaShape, spec: WorkloadSpec) -> float:
    """A mean prompt's steps, alone on a replica."""
    n_in = spec.input_len.mean
    hit = spec.prefix_len if spec.num_prefixes else 0  # a shared prefix is computed once per replica
    prompt = StepShape()
    prompt.add_row(max(1, n_in - hit), hit)
    chunks = math.ceil(max(1, n_in - hit) / shape.max_num_batched_tokens)
    return profile.step_seconds(prompt) + (chunks - 1) * profile.mixed.coef[0]


def decode_step(profile: NodeProfile, shape: ReplicaShape, spec: WorkloadSpec) -> tuple[int, float]:
    """The largest decode batch of mean requests a replica holds, and the cost of its step."""
    n_in, n_out = spec.input_len.mean, spec.output_len.mean
    batch = max(1, min(shape.max_num_seqs, profile.kv_tokens // max(1, n_in + n_out)))
    decode = StepShape()
    for _ in range(batch):
        decode.add_row(1, n_in + n_out // 2)
    return batch, profile.step_seconds(decode)


def replica_capacity(
    profile: NodeProfile, shape: ReplicaShape, spec: WorkloadSpec
) -> tuple[float, list[str]]:
    """Requests per second one replica can finish at most, and the arithmetic behind it."""
    n_in, n_out = spec.input_len.mean, spec.output_len.mean
    hit = spec.prefix_len if spec.num_prefixes else 0
    batch, step = decode_step(profile, shape, spec)
    prefill = prompt_seconds(profile, shape, spec)
    per_request = n_out * step / batch + prefill
    notes = [
        f"a decode step of {batch} rows at context {n_in + n_out // 2}: {1e3 * step:.2f} ms "
        f"= {batch / step:,.0f} tokens/s",
        f"a prompt of {n_in} tokens ({hit} cached): {1e3 * prefill:.1f} ms",
        f"per request: {n_out} x {1e3 * step:.2f} / {batch} + {1e3 * prefill:.1f} "
        f"= {1e3 * per_request:.1f} ms "
        f"of replica time, so at most {1 / per_request:.2f} requests/s per replica",
    ]
    return 1 / per_request, notes


def pd_capacity(profile: NodeProfile, shape: ReplicaShape, spec: WorkloadSpec) -> tuple[float, float]:
    """Requests per second a prefill worker and a decode worker finish at most, each paying its
    part of every handoff's CPU (packing and writing the K/V, reading and loading it)."""
    batch, step = decode_step(profile, shape, spec)
    n_in = round(spec.input_len.mean)
    prefill = prompt_seconds(profile, shape, spec) + profile.kv_handoff_cpu_seconds(n_in, "prefill")
    decode = spec.output_len.mean * step / batch + profile.kv_handoff_cpu_seconds(n_in, "decode")
    return 1 / prefill, 1 / decode


def pd_fleet(shape: ReplicaShape, prefill: int, decode: int, cfg: PlanConfig) -> FleetShape:
    return FleetShape(
        0,
        cfg.routing,
        shape,
        prefill=prefill,
        decode=decode,
        disagg_min_prompt_tokens=cfg.disagg_min_prompt_tokens,
        kv_transport=cfg.kv_transport,
    )


def simulate(profile: NodeProfile, fleet: FleetShape, spec: WorkloadSpec, n: int) -> dict:
    """The fast simulator's figures for a fleet, over n requests."""
    load = replace(spec, num_requests=n)
    return FastFleet(profile, fleet).run(load.requests(False)).summary()


def fleet_requests(workers: int, cfg: PlanConfig) -> int:
    return min(cfg.max_fleet_requests, max(cfg.requests_per_check, cfg.requests_per_replica * workers))


def check(
    profile: NodeProfile, shape: ReplicaShape, spec: WorkloadSpec, replicas: int, cfg: PlanConfig
) -> dict:
    """One replica at its share of the load (rate / replicas)."""
    share = replace(spec, rate=spec.rate / replicas)
    return simulate(profile, FleetShape(1, "least_load", shape), share, cfg.requests_per_check)


def fleet_check(
    profile: NodeProfile,
    shape: ReplicaShape,
    spec: WorkloadSpec,
    replicas: int,
    cfg: PlanConfig,
    scale: float = 1.0,
) -> dict:
    """The whole fleet: `replicas` replicas behind the routing policy, at `scale` x the load."""
    fleet = FleetShape(replicas, cfg.routing, shape)
    return simulate(profile, fleet, replace(spec, rate=spec.rate * scale), fleet_requests(replicas, cfg))


def candidate_check(
    profile: NodeProfile, spec: WorkloadSpec, c: Candidate, cfg: PlanConfig, scale: float = 1.0
) -> dict:
    """A candidate's whole fleet (P/D or not) at `scale` x the load."""
    load = replace(spec, rate=spec.rate * scale)
    return simulate(profile, c.fleet(cfg), load, fleet_requests(c.replicas, cfg))


def pd_check(
    profile: NodeProfile,
    shape: ReplicaShape,
    spec: WorkloadSpec,
    prefill: int,
    decode: int,
    cfg: PlanConfig,
    scale: float = 1.0,
) -> dict:
    """A P/D fleet of `prefill` + `decode` workers, at `scale` x the load."""
    fleet = pd_fleet(shape, prefill, decode, cfg)
    n = fleet_requests(prefill + decode, cfg)
    return simulate(profile, fleet, replace(spec, rate=spec.rate * scale), n)


def up_then_down(floor: int, limit: int, meets) -> tuple[int, dict] | None:
    """The fewest n >= floor for which `meets(n)` gives a summary: up by doubling until it does
    (None past `limit`, or past 64 x floor: more do not help), then down by halves."""
    low, high = floor - 1, floor
    while meets(high) is None:
        low, high = high, high * 2
        if high > limit or high > 64 * floor:
            return None
    return fewest(low, high, meets)


def fewest(low: int, high: int, meets) -> tuple[int, dict]:
    """The fewest replicas in (low, high] for which `meets(n)` gives a summary within the SLO
    (high must be one); by halving."""
    found = meets(high)
    while high - low > 1:
        mid = (low + high) // 2
        summary = meets(mid)
        if summary is not None:
            high, found = mid, summary
        else:
            low = mid
    return high, found


def fewest_replicas(
    profile: NodeProfile, shape: ReplicaShape, spec: WorkloadSpec, cfg: PlanConfig
) -> Candidate:
    capacity, _ = replica_capacity(profile, shape, spec)
    floor = max(1, math.ceil(spec.rate / capacity))
    if floor > cfg.max_replicas:
        return Candidate(shape, None, floor)

    def meets(n: int) -> dict | None:
        summary = check(profile, shape, spec, n, cfg)
        return summary if cfg.slo.met(summary) else None

    found = up_then_down(floor, cfg.max_replicas, meets)
    if found is None:
        return Candidate(shape, None, floor)  # more replicas do not help: the steps are too slow
    n, summary = found
    return Candidate(shape, n, floor, summary, split=n)


def fewest_pd(profile: NodeProfile, shape: ReplicaShape, spec: WorkloadSpec, cfg: PlanConfig) -> Candidate:
    """The cheapest P/D fleet of a shape: the fewest prefill workers that hold the TTFT bound with
    twice the decode workers the arithmetic asks, then the fewest decode workers behind those; then
    one prefill worker more at a time while that saves more decode workers than it costs (a decode
    worker's first step is part of the TTFT too)."""
    per_prefill, per_decode = pd_capacity(profile, shape, spec)
    p_floor, d_floor = (max(1, math.ceil(spec.rate / c)) for c in (per_prefill, per_decode))
    ttft_only = SLO(cfg.slo.ttft_p99_s)

    def prefill_meets(p: int) -> dict | None:
        summary = pd_check(profile, shape, spec, p, 2 * d_floor, cfg)
        return summary if ttft_only.met(summary) else None

    def fewest_decode(p: int) -> tuple[int, dict] | None:
        def meets(d: int) -> dict | None:
            summary = pd_check(profile, shape, spec, p, d, cfg)
            return summary if cfg.slo.met(summary) else None

        return up_then_down(d_floor, cfg.max_replicas - p, meets)

    found = up_then_down(p_floor, cfg.max_replicas, prefill_meets)
    best = None
    if found is not None:
        p = found[0]
        while (decode := fewest_decode(p)) is not None:
            d, summary = decode
            if best is not None and p + d >= best.replicas:
                break
            best = Candidate(shape, p + d, p_floor + d_floor, summary, prefill=p)
            if d == d_floor:
                break  # no decode worker left to save
            p += 1
    return best or Candidate(shape, None, p_floor + d_floor, prefill=p_floor)


def refine(profile: NodeProfile, spec: WorkloadSpec, c: Candidate, cfg: PlanConfig) -> Candidate:
    """The fewest replicas of a shape as a whole fleet behind the routing policy: fewer than the
    split's, since the gateway sends each request to a replica with room, not at random."""

    def meets(n: int) -> dict | None:
        summary = fleet_check(profile, c.shape, spec, n, cfg)
        return summary if cfg.slo.met(summary) else None

    n, summary = fewest(c.floor - 1, c.replicas, meets)
    return Candidate(c.shape, n, c.floor, summary or c.summary, split=c.split)


def plan(
    profile: NodeProfile, spec: WorkloadSpec, cfg: PlanConfig
) -> tuple[list[Candidate], Candidate | None]:
    if not math.isfinite(spec.rate) or spec.rate <= 0:
        raise ValueError("plan needs a finite arrival rate (requests per second, or users and think time)")
    out = []
    # A batch past what the KV cache holds at these lengths runs as that one does: tried once.
    fits = max(1, profile.kv_tokens // max(1, spec.input_len.mean + spec.output_len.mean))
    batches = sorted({min(b, max(fits, min(cfg.batch_sizes))) for b in cfg.batch_sizes})
    for batch in batches:
        for chunk in cfg.chunk_sizes:
            shape = ReplicaShape(max_num_seqs=batch, max_num_batched_tokens=chunk)
            out.append(fewest_replicas(profile, shape, spec, cfg))
    ok = [c for c in out if c.replicas is not None]
    if not ok:
        return out, None
    # The shapes close to the cheapest by the split are simulated whole, and the cheapest of those
    # wins; of equals, the one with the lower TTFT p99 (more headroom).
    least = min(c.replicas for c in ok)
    near = []
    for i, c in enumerate(out):
        if c.replicas is not None and c.replicas <= least * cfg.refine_within:
            out[i] = refine(profile, spec, c, cfg)
            near.append(c.shape)
    if cfg.disaggregated:
        # A prefill worker computes whole prompts whatever the chunk: one P/D fleet a batch size,
        # with the largest chunk of those near the cheapest.
        chunks = {s.max_num_seqs: s for s in sorted(near, key=lambda s: s.max_num_batched_tokens)}
        out += [fewest_pd(profile, shape, spec, cfg) for shape in chunks.values()]
    ok = [c for c in out if c.replicas is not None]
    best = min(ok, key=lambda c: (c.replicas, c.summary["ttft_s"]["p99"]))
    return out, best


@dataclass
class ScalingPlan:
    """An autoscaled pool of the cheapest shape, between its bounds, and what it saves."""

    scaling: ScalingShape
    summary: dict  # the pool's run
    fixed: dict  # the fixed fleet's run of the same requests

    def describe(self) -> str:
        s, a = self.scaling, self.scaling.autoscale
        saved = 1 - self.summary["replica_seconds"] / self.fixed["replica_seconds"]
        # A pool can cost more than the fixed fleet: on a steady load its starts and its slower
        # scale-down keep replicas up that the load does not need.
        change = f"{100 * saved:.0f} % fewer" if saved >= 0 else f"{-100 * saved:.0f} % more"
        return (
            f"autoscaled between {s.min_replicas} and {s.max_replicas} replicas "
            f"(target {a.target_inflight:.1f} in flight a replica, {s.warm_standby} warm standby, "
            f"up to {a.max_step} a step): {self.summary['replica_seconds']:,.0f} replica-s against "
            f"{self.fixed['replica_seconds']:,.0f} fixed ({change}), "
            f"TTFT p99 {1e3 * self.summary['ttft_s']['p99']:.1f} ms"
        )


def plan_scaling(profile: NodeProfile, spec: WorkloadSpec, best: Candidate, cfg: PlanConfig) -> ScalingPlan:
    """The least replica-seconds of an autoscaled pool of the cheapest (whole-replica) fleet: the
    fleet's size is its upper bound, the fewest replicas kept up that still hold the SLO through
    the workload (its bursts, the profile's cold starts) the lower, with and without a warm
    standby. The target in flight a replica is what one replica carries at the most steady load
    (no bursts) it takes within the SLO."""
    n = fleet_requests(best.replicas, cfg)
    fixed = candidate_check(profile, spec, best, cfg)
    steady = fewest_replicas(profile, best.shape, replace(spec, bursts=[]), cfg).summary or fixed
    per_replica = steady["request_throughput"] * steady["e2e_s"]["mean"]  # Little's law, on one replica
    if steady is fixed:
        per_replica /= best.replicas
    auto = AutoscaleConfig(target_inflight=max(1.0, per_replica), max_step=max(2, best.replicas // 8))
    found = []
    for warm in (0, 1):

        def meets(low: int, warm: int = warm) -> dict | None:
            pool = ScalingShape(low, best.replicas, warm, auto)
            fleet = FleetShape(routing=cfg.routing, replica=best.shape, scaling=pool)
            summary = simulate(profile, fleet, spec, n)
            return summary if cfg.slo.met(summary) else None

        if meets(best.replicas) is None:
            continue
        low, summary = fewest(0, best.replicas, meets)
        found.append(ScalingPlan(ScalingShape(low, best.replicas, warm, auto), summary, fixed))
    if not found:  # the fixed fleet only just holds: a pool of it, never scaled, is the fleet
        return ScalingPlan(ScalingShape(best.replicas, best.replicas, 0, auto), fixed, fixed)
    return min(found, key=lambda p: p.summary["replica_seconds"])


def users_to_rate(users: int, think_s: float, response_s: float) -> float:
    """Closed-loop users who each wait for an answer, then think: their arrival rate (Little's law)."""
    return users / (think_s + response_s)
