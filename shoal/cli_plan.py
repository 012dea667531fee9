"""`shoal plan`: the cheapest fleet that meets an SLO at a load, from one node profile or several
(one per parallel shape: the cheapest is the one that takes the fewest devices)."""

from __future__ import annotations

import sys
from dataclasses import replace

from shoal.cli_types import NON_NEGATIVE, POSITIVE, whole
from shoal.cli_workload import SIM_DEFAULT_PROFILE, add_workload_args, workload_spec
from shoal.fleet.routing.policies import POLICIES


def plan_for(profile, spec, cfg, args):
    """The plan of one profile (with closed-loop users, the rate their response time gives)."""
    from shoal.sim.planner import plan, users_to_rate

    if not args.users:
        return (spec, *plan(profile, spec, cfg))
    # Closed-loop users: the rate depends on the response time, which depends on the rate; start
    # from the think time alone (the highest rate), and plan again at the rate the first plan's
    # response time gives.
    response = 0.0
    spec = replace(spec, rate=users_to_rate(args.users, args.think_s, response))
    rows, best = plan(profile, spec, replace(cfg, disaggregated=False))  # for a response time only
    if best is not None:
        response = best.summary["e2e_s"]["mean"]
        spec = replace(spec, rate=users_to_rate(args.users, args.think_s, response))
        rows, best = plan(profile, spec, cfg)
    print(
        f"{args.users} users, each thinking {args.think_s:g} s between answers "
        f"of about {response:.2f} s: "
        f"{spec.rate:.2f} requests/s (Little's law: users / (think + response))"
    )
    return spec, rows, best


def report(profile, spec, cfg, args, rows, best) -> None:
    """The table, the cheapest fleet and its arithmetic, an autoscaled pool of it, and the what-if."""
    from shoal.sim.planner import candidate_check, pd_capacity, plan, plan_scaling, replica_capacity

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
        return
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
        if not args.no_autoscale:
            print(plan_scaling(profile, spec, best, cfg).describe())
    print_gateways(profile, spec, args)
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


def print_gateways(profile, spec, args) -> None:
    """The gateways in front of the fleet, whatever its shape: they relay the same tokens."""
    from shoal.sim.gateways import GatewaySizing, size_gateways

    sized = size_gateways(profile, spec.rate, spec.output_len.mean, GatewaySizing(spares=args.gateway_spares))
    if sized is None:
        print("gateways: not sized (this profile did not time a gateway: `shoal profile --through-gateway`)")
        return
    print(f"gateways: {sized.gateways}")
    for note in sized.notes:
        print(f"  {note}")


def devices(profile) -> int:
    """Devices (GPUs, or CPU workers) one replica of this profile's parallel shape takes."""
    return profile.tensor_parallel * profile.pipeline_parallel


def cmd_plan(args) -> int:
    from shoal.sim.planner import SLO, PlanConfig
    from shoal.sim.profile import NodeProfile

    try:
        profiles = [NodeProfile.load(p) for p in args.profile or [SIM_DEFAULT_PROFILE]]
        spec = workload_spec(args)
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    cfg = PlanConfig(SLO(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000 if args.slo_itl_ms else None))
    cfg.routing = args.routing
    cfg.disaggregated = not args.no_pd
    cfg.disagg_min_prompt_tokens = args.disagg_min_prompt_tokens
    cfg.kv_transport = args.kv_transport
    answers = []
    for i, profile in enumerate(profiles):
        print(("\n" if i else "") + profile.describe(), end="\n\n")
        load, rows, best = plan_for(profile, spec, cfg, args)
        report(profile, load, cfg, args, rows, best)
        if best is not None:
            answers.append((best.replicas * devices(profile), profile, best))
    if len(profiles) > 1 and answers:
        print("\nby parallel shape (devices = workers x TP x PP):")
        for n, profile, best in sorted(answers, key=lambda a: a[0]):
            shape = f"TP={profile.tensor_parallel} PP={profile.pipeline_parallel}"
            print(f"  {shape}: {best.describe()}: {n} devices")
    return 0 if answers else 1


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="the cheapest fleet shape that meets an SLO at a load, from a profile")
    p.add_argument(
        "--profile",
        action="append",
        default=None,
        help="a node profile (repeat for one per parallel shape; default: " + SIM_DEFAULT_PROFILE + ")",
    )
    p.add_argument("--slo-ttft-ms", type=POSITIVE, default=2000.0, help="TTFT p99 bound")
    p.add_argument("--slo-itl-ms", type=POSITIVE, default=None, help="ITL p99 bound")
    p.add_argument("--users", type=whole(1), default=None, help="closed-loop users instead of --rate")
    p.add_argument(
        "--think-s", type=NON_NEGATIVE, default=10.0, help="each user's pause between answer and next request"
    )
    p.add_argument("--routing", choices=tuple(POLICIES), default="least_load")
    p.add_argument(
        "--what-if", type=NON_NEGATIVE, default=2.0, help="also simulate this multiple of the load (0: not)"
    )
    p.add_argument("--no-pd", action="store_true", help="leave out P/D fleets")
    p.add_argument(
        "--gateway-spares", type=whole(0), default=1, help="gateways beyond what the load needs, to lose"
    )
    p.add_argument(
        "--no-autoscale", action="store_true", help="skip sizing an autoscaled pool of the cheapest fleet"
    )
    p.add_argument(
        "--disagg-min-prompt-tokens",
        type=whole(0),
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
