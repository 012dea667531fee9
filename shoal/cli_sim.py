"""`shoal profile`, `shoal sim` and `shoal plan`: capacity planning (shoal/sim)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

from shoal.cli_options import add_engine_args, engine_options

SIM_DEFAULT_PROFILE = "shoal-profile.json"
AUTO_FAST_FROM = 20_000  # requests past which `shoal sim --mode auto` runs the fast simulator


def cmd_profile(args) -> int:
    from shoal.sim.profiler import ProfileConfig, measure

    cfg = ProfileConfig({"model": args.model, **engine_options(args)}, startup=not args.no_startup)
    if not args.no_server:
        cfg.serve_flags = engine_flags(args.argv)
        cfg.through_gateway = args.through_gateway
    if args.quick:
        cfg.decode_batches, cfg.contexts, cfg.prompt_lengths, cfg.repeats = (
            (1, 4, 16, 32),
            (32, 512),
            (64, 512),
            1,
        )
    profile = measure(cfg)
    profile.save(args.out)
    print(profile.describe())
    print(f"saved to {args.out}")
    return 0


PROFILE_OWN_FLAGS = {"--out": 1, "--quick": 0, "--no-startup": 0, "--no-server": 0, "--through-gateway": 0}


def engine_flags(argv: list[str]) -> list[str]:
    """`shoal profile`'s command line less its own flags: the engine's, for `shoal serve`."""
    rest = argv[argv.index("profile") + 1 :]
    out, skip = [], 0
    for arg in rest:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in PROFILE_OWN_FLAGS:
            skip = PROFILE_OWN_FLAGS[name] if "=" not in arg else 0
            continue
        out.append(arg)
    return out


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


def scaling_shape(args):
    """The autoscaled pool the flags ask for, or None (a fixed --replicas)."""
    if args.max_replicas is None:
        return None
    from shoal.fleet.control.autoscaler import AutoscaleConfig
    from shoal.sim.scaling import ScalingShape

    auto = AutoscaleConfig(
        target_inflight=args.target_inflight,
        scale_up_delay_s=args.scale_up_delay,
        scale_down_delay_s=args.scale_down_delay,
    )
    return ScalingShape(
        args.min_replicas, args.max_replicas, args.warm_standby, auto, args.scale_to_zero_after, args.start_s
    )


def cmd_sim(args) -> int:
    from shoal.bench.report import format_summary, plot
    from shoal.sim.fast import FastFleet
    from shoal.sim.fleet import FleetShape, FleetSim
    from shoal.sim.profile import NodeProfile
    from shoal.sim.replica import ReplicaShape
    from shoal.sim.workload import load_trace

    try:
        profile = NodeProfile.load(args.profile)
        reqs = load_trace(args.trace, profile.block_size) if args.trace else None
        spec = None if args.trace else workload_spec(args)
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    n = len(reqs) if reqs is not None else spec.num_requests
    disaggregated = bool(args.prefill or args.decode)
    if disaggregated and (not args.prefill or not args.decode):
        print("shoal: a P/D fleet takes --prefill N and --decode M", file=sys.stderr)
        return 2
    fast = args.mode == "fast" or (args.mode == "auto" and n > AUTO_FAST_FROM)
    if reqs is None:
        reqs = spec.requests(with_tokens=not fast)
    shape = FleetShape(
        args.replicas,
        args.routing,
        ReplicaShape(
            args.max_num_seqs or profile.max_num_seqs,
            args.max_num_batched_tokens or profile.max_num_batched_tokens,
            None if args.request_overhead_ms is None else args.request_overhead_ms / 1000,
        ),
        args.max_concurrency,
        prefill=args.prefill or 0,
        decode=args.decode or 0,
        disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
        kv_transport=args.kv_transport,
        scaling=scaling_shape(args),
    )
    if shape.scaling is not None and disaggregated:
        print(
            "shoal: an autoscaled pool is of whole replicas, not prefill and decode workers", file=sys.stderr
        )
        return 2
    t0 = time.perf_counter()
    result = (FastFleet if fast else FleetSim)(profile, shape).run(reqs)
    took = time.perf_counter() - t0
    slo_ttft = args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None
    slo_tpot = args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None
    summary = result.summary(slo_ttft, slo_tpot)
    workers = f"{shape.prefill} prefill + {shape.decode} decode" if disaggregated else f"{shape.replicas}"
    if shape.scaling is not None:
        workers = f"{shape.scaling.min_replicas} to {shape.scaling.max_replicas} (autoscaled)"
    print(f"simulated {workers} replica(s) of {profile.model} on {profile.machine}, routing {shape.routing}")
    print(format_summary(summary))
    print(f"replica-s       : {result.replica_seconds:.1f} ({result.steps} steps)")
    print(f"simulated in    : {took:.1f} s ({'fast' if fast else 'exact'})")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(summary, f, indent=2)
    if args.plot_path:
        if fast:
            print("shoal: --plot needs each request's tokens: use --mode exact", file=sys.stderr)
            return 2
        plot(result.records, args.plot_path)
    return 0


def cmd_plan(args) -> int:
    from shoal.sim.planner import (
        SLO,
        PlanConfig,
        candidate_check,
        pd_capacity,
        plan,
        plan_scaling,
        replica_capacity,
        users_to_rate,
    )
    from shoal.sim.profile import NodeProfile

    try:
        profile = NodeProfile.load(args.profile)
        spec = workload_spec(args)
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    cfg = PlanConfig(SLO(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000 if args.slo_itl_ms else None))
    cfg.routing = args.routing
    cfg.disaggregated = not args.no_pd
    cfg.disagg_min_prompt_tokens = args.disagg_min_prompt_tokens
    cfg.kv_transport = args.kv_transport
    response = 0.0
    if args.users:
        # Closed-loop users: the rate depends on the response time, which depends on the rate;
        # start from the think time alone (the highest rate) and refine from the plan's own answer.
        spec.rate = users_to_rate(args.users, args.think_s, 0.0)
    print(profile.describe(), end="\n\n")
    for _ in range(2 if args.users else 1):
        rows, best = plan(profile, spec, cfg)
        if best is None or not args.users:
            break
        response = best.summary["e2e_s"]["mean"]
        spec.rate = users_to_rate(args.users, args.think_s, response)
    if args.users:
        print(
            f"{args.users} users, each thinking {args.think_s:g} s between answers "
            f"of about {response:.2f} s: "
            f"{spec.rate:.2f} requests/s (Little's law: users / (think + response))"
        )
    print(
        f"load {spec.rate:.2f} requests/s of {spec.input_len.mean} prompt "
        f"and {spec.output_len.mean} output tokens;"
    )
    print(
        f"SLO: TTFT p99 <= {args.slo_ttft_ms:g} ms"
        + (f", ITL p99 <= {args.slo_itl_ms:g} ms" if args.slo_itl_ms else "")
    )
    print()
    for row in rows:
        print(row.row())
    if best is None:
        print("\nno shape meets the SLO within the replica limit")
        return 1
    print(f"\ncheapest: {best.describe()}")
    pd = [r for r in rows if r.prefill and r.replicas is not None]
    if best.prefill:
        per_prefill, per_decode = pd_capacity(profile, best.shape, spec)
        print(
            f"  a prefill worker computes at most {per_prefill:.2f} prompts/s and a decode worker "
            f"answers {per_decode:.2f} requests/s: at {spec.rate:.2f} requests/s at least "
            f"{spec.rate / per_prefill:.1f} + {spec.rate / per_decode:.1f} workers; "
            f"K/V handed over {cfg.kv_transport}"
        )
    else:
        for note in replica_capacity(profile, best.shape, spec)[1]:
            print(f"  {note}")
        if pd:
            print(f"cheapest P/D fleet: {min(pd, key=lambda c: c.replicas).describe()}")
    if not best.prefill and not args.no_autoscale:
        print(plan_scaling(profile, spec, best, cfg).describe())
    for scale in (1.0, *([args.what_if] if args.what_if else [])):
        s = candidate_check(profile, spec, best, cfg, scale)
        verdict = "meets" if cfg.slo.met(s) else "MISSES"
        print(
            f"whole fleet at {scale:g}x ({cfg.routing}): TTFT p99 {1e3 * s['ttft_s']['p99']:.1f} ms, "
            f"ITL p99 {1e3 * (s['itl_s']['p99'] or 0):.1f} ms, {s['request_throughput']:.2f} req/s: "
            f"{verdict} the SLO"
        )
        if scale != 1.0 and not cfg.slo.met(s):
            more = plan(profile, replace(spec, rate=spec.rate * scale), cfg)[1]
            if more is not None:
                print(f"  at {scale:g}x it takes {more.describe()}")
    return 0


def add_sim_parsers(sub, wanted) -> None:
    p = sub.add_parser(
        "profile", help="measure this node's step costs, KV capacity and start-up into a profile"
    )
    p.add_argument("--out", default=SIM_DEFAULT_PROFILE)
    p.add_argument(
        "--quick", action="store_true", help="fewer shapes (a rougher fit, in a fraction of the time)"
    )
    p.add_argument("--no-startup", action="store_true", help="skip timing a replica's start")
    p.add_argument(
        "--no-server",
        action="store_true",
        help="skip calibrating to a real `shoal serve` (engine steps only)",
    )
    p.add_argument(
        "--through-gateway",
        action="store_true",
        help="calibrate behind a gateway on this machine (when the gateway shares the replicas' cores)",
    )
    if wanted("profile"):
        add_engine_args(p)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("sim", help="simulate a fleet serving a workload, from a node profile")
    p.add_argument("--profile", default=SIM_DEFAULT_PROFILE)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--prefill", type=int, default=None, help="a P/D fleet: this many prefill workers")
    p.add_argument("--decode", type=int, default=None, help="... and this many decode workers")
    p.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=256,
        help="prompts with fewer uncached tokens are prefilled on their decode worker",
    )
    p.add_argument("--kv-transport", choices=("shm", "tcp"), default="shm", help="a P/D fleet's K/V handoff")
    g = p.add_argument_group("an autoscaled pool (instead of --replicas)")
    g.add_argument("--max-replicas", type=int, default=None, help="scale between --min-replicas and this")
    g.add_argument("--min-replicas", type=int, default=1)
    g.add_argument("--warm-standby", type=int, default=0, help="loaded replicas out of traffic")
    g.add_argument("--scale-to-zero-after", type=float, default=None, metavar="S")
    g.add_argument("--target-inflight", type=float, default=8.0, help="requests in flight per replica")
    g.add_argument("--scale-up-delay", type=float, default=1.0, metavar="S")
    g.add_argument("--scale-down-delay", type=float, default=30.0, metavar="S")
    g.add_argument("--start-s", type=float, default=None, help="a cold start (default: the profile's)")
    p.add_argument("--routing", default="least_load")
    p.add_argument(
        "--mode",
        choices=("auto", "exact", "fast"),
        default="auto",
        help=f"exact: the engine's own scheduler per replica; fast: its rules in aggregate, for "
        f"large fleets (auto: fast past {AUTO_FAST_FROM:,} requests)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-concurrency", type=int, default=None, help="the clients' cap on requests in flight")
    p.add_argument(
        "--request-overhead-ms",
        type=float,
        default=None,
        help="time a request spends outside the engine (default: the profile's, from a real server)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--plot", dest="plot_path", default=None, help="a PNG of latencies over the run")
    add_workload_args(p)
    p.set_defaults(func=cmd_sim)

    p = sub.add_parser("plan", help="the cheapest fleet shape that meets an SLO at a load, from a profile")
    p.add_argument("--profile", default=SIM_DEFAULT_PROFILE)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT p99 bound")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="ITL p99 bound")
    p.add_argument("--users", type=int, default=None, help="closed-loop users instead of --rate")
    p.add_argument(
        "--think-s", type=float, default=10.0, help="each user's pause between answer and next request"
    )
    p.add_argument("--routing", default="least_load")
    p.add_argument("--what-if", type=float, default=2.0, help="also simulate this multiple of the load")
    p.add_argument("--no-pd", action="store_true", help="leave out P/D fleets")
    p.add_argument(
        "--no-autoscale", action="store_true", help="skip sizing an autoscaled pool of the cheapest fleet"
    )
    p.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=256,
        help="a P/D fleet prefills prompts with fewer uncached tokens on their decode worker",
    )
    p.add_argument(
        "--kv-transport",
        choices=("shm", "tcp"),
        default="tcp",
        help="how a P/D fleet's K/V goes from prefill to decode worker (tcp: on other hosts)",
    )
    add_workload_args(p)
    p.set_defaults(func=cmd_plan)
