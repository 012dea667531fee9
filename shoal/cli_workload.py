"""The workload flags `shoal sim` and `shoal plan` share, and the profile they read by default."""

from __future__ import annotations

import argparse
import math

SIM_DEFAULT_PROFILE = "shoal-profile.json"


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (or --trace)")
    g.add_argument("--trace", default=None, help="a trace the gateway recorded (JSON lines)")
    g.add_argument("--num-requests", type=int, default=1000)
    g.add_argument(
        "--rate", type=float, default=math.inf, help="mean arrivals per second (default: all at once)"
    )
    g.add_argument(
        "--burst", nargs=3, type=float, action="append", default=[], metavar=("START_S", "LENGTH_S", "FACTOR")
    )
    g.add_argument("--input-len", default="256", help="N, uniform:MEAN:SPREAD or lognormal:MEAN:SIGMA")
    g.add_argument("--output-len", default="128", help="as --input-len")
    g.add_argument("--num-prefixes", type=int, default=0, help="shared prompt prefixes")
    g.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix")
    g.add_argument("--seed", type=int, default=0)


def workload_spec(args):
    from shoal.sim.workload import Burst, Lengths, WorkloadSpec

    return WorkloadSpec(
        num_requests=args.num_requests,
        rate=args.rate,
        bursts=[Burst(*b) for b in args.burst],
        input_len=Lengths.parse(args.input_len),
        output_len=Lengths.parse(args.output_len),
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        seed=args.seed,
    )
