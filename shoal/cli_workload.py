"""The workload flags `shoal sim` and `shoal plan` share, and the profile they read by default."""

from __future__ import annotations

import argparse
import math

from shoal.cli_types import POSITIVE, whole

SIM_DEFAULT_PROFILE = "shoal-profile.json"


def burst_flag(text: str):
    """--burst START:LENGTH:FACTOR, as argparse takes a type."""
    from shoal.bench.arrivals import Burst

    try:
        return Burst.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (or --trace)")
    g.add_argument("--trace", default=None, help="a trace the gateway recorded (JSON lines)")
    g.add_argument("--num-requests", type=whole(1), default=1000)
    g.add_argument(
        "--rate", type=POSITIVE, default=math.inf, help="mean arrivals per second (default: all at once)"
    )
    g.add_argument(
        "--burst",
        nargs="+",
        type=burst_flag,
        action="extend",
        default=[],
        metavar="START:LENGTH:FACTOR",
        help="spells of FACTOR x the rate, LENGTH seconds from START seconds into the run",
    )
    g.add_argument("--input-len", default="256", help="N, uniform:MEAN:SPREAD or lognormal:MEAN:SIGMA")
    g.add_argument("--output-len", default="128", help="as --input-len")
    g.add_argument("--num-prefixes", type=whole(0), default=0, help="shared prompt prefixes")
    g.add_argument("--prefix-len", type=whole(0), default=0, help="tokens of each shared prefix")
    g.add_argument("--seed", type=int, default=0)


def workload_spec(args):
    from shoal.sim.workload import Lengths, WorkloadSpec

    return WorkloadSpec(
        num_requests=args.num_requests,
        rate=args.rate,
        bursts=list(args.burst),
        input_len=Lengths.parse(args.input_len),
        output_len=Lengths.parse(args.output_len),
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        seed=args.seed,
    )
