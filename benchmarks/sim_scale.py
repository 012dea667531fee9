"""Issue 31's scale goal: `shoal sim` over 10,000 replicas and 1,000,000 requests in under 60 s.

    python benchmarks/sim_scale.py [--profile shoal-profile.json] [--replicas 10000] [--requests 1000000]

Without a profile it uses one of made-up costs (10 ms a step, 0.5 ms a row, 0.2 ms a prompt token)
of the bundled model's shape; the time the simulator takes depends on the events it handles (one
replica's stretch of decode steps is one), not on the costs. The load is 80 % of what the fleet
can carry, with shared prefixes and kv_aware routing, so every part of the simulator runs.
"""

from __future__ import annotations

import argparse
import time

from shoal.sim.fast import FastFleet
from shoal.sim.fleet import FleetShape
from shoal.sim.planner import replica_capacity
from shoal.sim.profile import NodeProfile, made_up_profile
from shoal.sim.replica import ReplicaShape
from shoal.sim.workload import Lengths, WorkloadSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None)
    ap.add_argument("--replicas", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--routing", default="kv_aware")
    args = ap.parse_args()
    profile = NodeProfile.load(args.profile) if args.profile else made_up_profile(num_blocks=8192)
    shape = ReplicaShape(64, 2048)
    spec = WorkloadSpec(
        num_requests=args.requests,
        input_len=Lengths("uniform", 512, 256),
        output_len=Lengths("uniform", 128, 96),
        num_prefixes=256,
        prefix_len=256,
    )
    capacity, _ = replica_capacity(profile, shape, spec)
    spec.rate = 0.8 * capacity * args.replicas
    t0 = time.perf_counter()
    requests = spec.requests(with_tokens=False)
    t1 = time.perf_counter()
    result = FastFleet(profile, FleetShape(args.replicas, args.routing, shape)).run(requests)
    t2 = time.perf_counter()
    s = result.summary()
    print(
        f"{args.replicas:,} replicas, {args.requests:,} requests at {spec.rate:,.0f} req/s ({args.routing}): "
        f"{s['duration_s']:.0f} s of fleet time, {result.steps:,} replica steps"
    )
    print(
        f"TTFT p50 {1e3 * s['ttft_s']['p50']:.1f} ms, p99 {1e3 * s['ttft_s']['p99']:.1f} ms; ITL p50 "
        f"{1e3 * s['itl_s']['p50']:.1f} ms; {s['output_token_throughput']:,.0f} output tokens/s"
    )
    print(
        f"workload drawn in {t1 - t0:.1f} s, simulated in {t2 - t1:.1f} s, total {t2 - t0:.1f} s "
        f"(goal: under 60 s)"
    )


if __name__ == "__main__":
    main()
