"""`shoal profile`, `shoal sim` and `shoal plan`: capacity planning (shoal/sim)."""

from __future__ import annotations

import json
import sys
import time

from shoal.cli_options import add_engine_args, engine_options
from shoal.cli_plan import add_plan_parser
from shoal.cli_types import NON_NEGATIVE, POSITIVE, whole, whole_list
from shoal.cli_workload import SIM_DEFAULT_PROFILE, add_workload_args, workload_spec
from shoal.fleet.routing.policies import POLICIES

AUTO_FAST_FROM = 20_000  # requests past which `shoal sim --mode auto` runs the fast simulator


def cmd_profile(args) -> int:
    from shoal.sim.profiler import ProfileConfig, measure

    cfg = ProfileConfig(
        {"model": args.model, **engine_options(args)},
        startup=not args.no_startup,
        speed_probe=not args.no_speed_probe,
        save_to=args.out,
        samples_to=args.samples,
    )
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
    if args.decode_batches:
        cfg.decode_batches = args.decode_batches
    profile = measure(cfg)
    print(profile.describe())
    print(f"saved to {args.out}")
    return 0


PROFILE_OWN_FLAGS = {
    "--out": 1,
    "--samples": 1,
    "--quick": 0,
    "--decode-batches": 1,
    "--no-startup": 0,
    "--no-server": 0,
    "--through-gateway": 0,
}


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
    if args.shared_cores is not None and args.mode == "fast":
        print("shoal: --shared-cores needs the exact simulator (--mode exact)", file=sys.stderr)
        return 2
    noisy = bool(args.decode_step_noise or args.prompt_step_noise)
    auto_fast = args.mode == "auto" and n > AUTO_FAST_FROM and args.shared_cores is None and not noisy
    fast = args.mode == "fast" or auto_fast
    if reqs is None:
        reqs = spec.requests(with_tokens=not fast)
    try:  # the pool's shape and the simulators check what does not go together
        replica = ReplicaShape(
            args.max_num_seqs or profile.max_num_seqs,
            args.max_num_batched_tokens or profile.max_num_batched_tokens,
            None if args.request_overhead_ms is None else args.request_overhead_ms / 1000,
            args.decode_step_noise,
            args.prompt_step_noise,
        )
        shape = FleetShape(
            args.replicas,
            args.routing,
            replica,
            args.max_concurrency,
            prefill=args.prefill or 0,
            decode=args.decode or 0,
            disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
            kv_transport=args.kv_transport,
            prefill_timeout_s=args.prefill_timeout_s or FleetShape.prefill_timeout_s,
            scaling=scaling_shape(args),
            shared_cores=args.shared_cores,
        )
        sim = (FastFleet if fast else FleetSim)(profile, shape)
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = sim.run(reqs)
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


def add_sim_parsers(sub, wanted) -> None:
    p = sub.add_parser(
        "profile", help="measure this node's step costs, KV capacity and start-up into a profile"
    )
    p.add_argument("--out", default=SIM_DEFAULT_PROFILE)
    p.add_argument(
        "--quick", action="store_true", help="fewer shapes (a rougher fit, in a fraction of the time)"
    )
    p.add_argument(
        "--decode-batches",
        type=whole_list(1),
        metavar="B,B,...",
        help="decode batch sizes to time (default 1,2,4,...,64; a GPU serves larger ones: add 128,256 "
        "with --max-num-seqs 256)",
    )
    p.add_argument(
        "--samples", metavar="PATH", default=None, help="also write every timed step (JSON lines) to PATH"
    )
    p.add_argument("--no-startup", action="store_true", help="skip timing a replica's start")
    p.add_argument(
        "--no-speed-probe",
        action="store_true",
        help="skip pricing the speed probe (the host's speed, to rescale the profile by later) and "
        "probing the host before the serving calibration",
    )
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
    p.add_argument("--replicas", type=whole(1), default=1)
    p.add_argument("--prefill", type=whole(1), default=None, help="a P/D fleet: this many prefill workers")
    p.add_argument("--decode", type=whole(1), default=None, help="... and this many decode workers")
    p.add_argument(
        "--disagg-min-prompt-tokens",
        type=whole(0),
        default=256,
        help="prompts with fewer uncached tokens are prefilled on their decode worker",
    )
    p.add_argument("--kv-transport", choices=("shm", "tcp"), default="shm", help="a P/D fleet's K/V handoff")
    p.add_argument(
        "--prefill-timeout-s",
        type=POSITIVE,
        default=None,
        metavar="S",
        help="a remote prefill not done in this long is prefilled on its decode worker (default: the "
        "gateway's, 30)",
    )
    g = p.add_argument_group("an autoscaled pool (instead of --replicas)")
    g.add_argument(
        "--max-replicas", type=whole(1), default=None, help="scale between --min-replicas and this"
    )
    g.add_argument("--min-replicas", type=whole(0), default=1)
    g.add_argument("--warm-standby", type=whole(0), default=0, help="loaded replicas out of traffic")
    g.add_argument("--scale-to-zero-after", type=NON_NEGATIVE, default=None, metavar="S")
    g.add_argument("--target-inflight", type=POSITIVE, default=8.0, help="requests in flight per replica")
    g.add_argument("--scale-up-delay", type=NON_NEGATIVE, default=1.0, metavar="S")
    g.add_argument("--scale-down-delay", type=NON_NEGATIVE, default=30.0, metavar="S")
    g.add_argument("--start-s", type=NON_NEGATIVE, default=None, help="a cold start (default: the profile's)")
    p.add_argument("--routing", choices=tuple(POLICIES), default="least_load")
    p.add_argument(
        "--mode",
        choices=("auto", "exact", "fast"),
        default="auto",
        help=f"exact: the engine's own scheduler per replica; fast: its rules in aggregate, for "
        f"large fleets (auto: fast past {AUTO_FAST_FROM:,} requests)",
    )
    p.add_argument("--max-num-seqs", type=whole(1), default=None)
    p.add_argument("--max-num-batched-tokens", type=whole(1), default=None)
    p.add_argument(
        "--max-concurrency", type=whole(1), default=None, help="the clients' cap on requests in flight"
    )
    p.add_argument(
        "--shared-cores",
        type=whole(1),
        default=None,
        metavar="N",
        help="the replicas (pinned to the profile's threads), the gateway and the clients all run on "
        "N cores of one host: the front's CPU, from a profile calibrated --through-gateway, is taken "
        "from the replicas' steps",
    )
    p.add_argument(
        "--request-overhead-ms",
        type=NON_NEGATIVE,
        default=None,
        help="time a request spends outside the engine (default: the profile's, from a real server)",
    )
    for kind, what in (("decode", "decodes only"), ("prompt", "prompt tokens")):
        p.add_argument(
            f"--{kind}-step-noise",
            type=NON_NEGATIVE,
            default=0.0,
            metavar="SD",
            help=f"how far a step of {what} strays from its price, step to step: the standard "
            "deviation of log(seconds / price), as a real run's traced steps show it (exact simulator)",
        )
    p.add_argument("--slo-ttft-ms", type=POSITIVE, default=None)
    p.add_argument("--slo-tpot-ms", type=POSITIVE, default=None)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--plot", dest="plot_path", default=None, help="a PNG of latencies over the run")
    add_workload_args(p)
    p.set_defaults(func=cmd_sim)

    add_plan_parser(sub)
