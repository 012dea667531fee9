"""`shoal plan`: the cheapest fleet shape that meets an SLO at a given load, from a node profile.

For each replica shape (max batch, prefill chunk) it finds the fewest replicas that meet the SLO:
the arithmetic gives a floor (what one replica can carry at all), and the simulator checks one
replica at its share of the load (rate / N: a gateway that sends each request where there is room
does no worse than that random split), stepping N up until the percentiles hold. The shapes
closest to the cheapest are then simulated whole, N replicas behind the routing policy, and N
brought down to the fewest that still hold. All of it on the fast simulator (fast.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from shoal.sim.fast import FastFleet
from shoal.sim.fleet import FleetShape
from shoal.sim.profile import NodeProfile, StepShape
from shoal.sim.replica import ReplicaShape
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


@dataclass
class Candidate:
    shape: ReplicaShape
    replicas: int | None  # None: no number of replicas meets the SLO
    floor: int  # the arithmetic's least number of replicas
    summary: dict | None = None  # the simulation that decided `replicas`
    split: int | None = None  # replicas by the split (one replica at rate / N), before refining

    def row(self) -> str:
        s = self.shape
        head = f"batch {s.max_num_seqs:>4}  chunk {s.max_num_batched_tokens:>5}  floor {self.floor:>6}"
        if self.replicas is None:
            return f"{head}  split      -  (the SLO is out of reach of this shape)"
        m = self.summary
        whole = f"{self.replicas:>6}" if self.replicas != self.split else "     ="
        return (
            f"{head}  split {self.split:>6}  whole {whole}  TTFT p99 {1e3 * m['ttft_s']['p99']:8.1f} ms  "
            f"ITL p99 {1e3 * (m['itl_s']['p99'] or 0):7.1f} ms"
        )


def replica_capacity(
    profile: NodeProfile, shape: ReplicaShape, spec: WorkloadSpec
) -> tuple[float, list[str]]:
    """Requests per second one replica can finish at most, and the arithmetic behind it."""
    n_in, n_out = spec.input_len.mean, spec.output_len.mean
    hit = spec.prefix_len if spec.num_prefixes else 0  # a shared prefix is computed once per replica
    batch = max(1, min(shape.max_num_seqs, profile.kv_tokens // max(1, n_in + n_out)))
    decode = StepShape()
    for _ in range(batch):
        decode.add_row(1, n_in + n_out // 2)
    step = profile.step_seconds(decode)
    prompt = StepShape()
    prompt.add_row(max(1, n_in - hit), hit)
    chunks = math.ceil(max(1, n_in - hit) / shape.max_num_batched_tokens)
    prefill = profile.step_seconds(prompt) + (chunks - 1) * profile.mixed.coef[0]
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


def simulate(
    profile: NodeProfile, shape: ReplicaShape, spec: WorkloadSpec, replicas: int, routing: str, n: int
) -> dict:
    """The fast simulator's figures for `replicas` replicas behind `routing`, over n requests."""
    load = replace(spec, num_requests=n)
    return FastFleet(profile, FleetShape(replicas, routing, shape)).run(load.requests(False)).summary()


def check(
    profile: NodeProfile, shape: ReplicaShape, spec: WorkloadSpec, replicas: int, cfg: PlanConfig
) -> dict:
    """One replica at its share of the load (rate / replicas)."""
    share = replace(spec, rate=spec.rate / replicas)
    return simulate(profile, shape, share, 1, "least_load", cfg.requests_per_check)


def fleet_check(
    profile: NodeProfile,
    shape: ReplicaShape,
    spec: WorkloadSpec,
    replicas: int,
    cfg: PlanConfig,
    scale: float = 1.0,
) -> dict:
    """The whole fleet: `replicas` replicas behind the routing policy, at `scale` x the load."""
    n = min(cfg.max_fleet_requests, max(cfg.requests_per_check, cfg.requests_per_replica * replicas))
    return simulate(profile, shape, replace(spec, rate=spec.rate * scale), replicas, cfg.routing, n)


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

    # Up by doubling until the SLO holds, then down by halves to the fewest that still hold it.
    low, high = floor - 1, floor
    while meets(high) is None:
        low, high = high, high * 2
        if high > cfg.max_replicas or high > 64 * floor:
            return Candidate(shape, None, floor)  # more replicas do not help: the steps are too slow
    n, summary = fewest(low, high, meets)
    return Candidate(shape, n, floor, summary, split=n)


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
    for i, c in enumerate(out):
        if c.replicas is not None and c.replicas <= least * cfg.refine_within:
            out[i] = refine(profile, spec, c, cfg)
    ok = [c for c in out if c.replicas is not None]
    best = min(ok, key=lambda c: (c.replicas, c.summary["ttft_s"]["p99"]))
    return out, best


def users_to_rate(users: int, think_s: float, response_s: float) -> float:
    """Closed-loop users who each wait for an answer, then think: their arrival rate (Little's law)."""
    return users / (think_s + response_s)
