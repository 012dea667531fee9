"""`shoal fleet up|update|status` and `shoal gateway`: the fleet's commands."""

from __future__ import annotations

import json
import sys

from shoal.cli_flags import Flag, FlagSet, add_flags, given
from shoal.cli_options import format_size, parse_size
from shoal.cli_types import NON_NEGATIVE, POSITIVE, fraction, whole
from shoal.protocol.secrets import api_key_from


def gateway_flag_set() -> FlagSet:
    from shoal.fleet.config import GatewayConfig
    from shoal.fleet.routing.policies import POLICIES

    return FlagSet(
        GatewayConfig,
        (
            Flag("host"),
            Flag("port"),
            Flag("policy", choices=POLICIES),
            Flag(
                "api_key", help="require 'Authorization: Bearer KEY' (not on probes; default $SHOAL_API_KEY)"
            ),
            Flag("replica_api_key", help="the key the gateway sends to replicas (default: --api-key)"),
            Flag("kv_salt", help="salt of KV block hashes (default: $SHOAL_KV_SALT, else from the key)"),
            Flag(
                "max_body_bytes",
                names=("--max-request-bytes",),
                parse=parse_size,
                show=format_size,
                help="larger bodies get 413",
            ),
            Flag("trust_client_priority", help="pass a client's priority on as given"),
            Flag("rebalance", help="move running streams off replicas with a queue or a full KV cache"),
            Flag("tokenizer", help="checkpoint whose tokenizer hashes prompts"),
            Flag("record_trace", metavar="PATH", help="append a JSON line per request served, for shoal sim"),
            Flag(
                "store",
                metavar="URL",
                help="a Redis URL (redis://host:6379/0): tenants' rate limits shared with every gateway "
                "over the same store (the redis extra)",
            ),
            Flag(
                "otlp_traces_endpoint",
                metavar="URL",
                help="export OpenTelemetry spans (the gateway's and its replicas') over OTLP/HTTP to URL "
                "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; none: off)",
            ),
            Flag(
                "shutdown_timeout_s",
                names=("--shutdown-timeout",),
                help="on SIGTERM, seconds the requests in flight get to finish (new connections are "
                "refused) before the replicas are stopped",
            ),
        ),
    )


def fleet_flag_sets() -> tuple[FlagSet, FlagSet, FlagSet]:
    """`shoal fleet up`'s own flags: the fleet's size, its autoscaler, and the disaggregation cut."""
    from shoal.fleet.config import FleetConfig, GatewayConfig
    from shoal.fleet.control.autoscaler import AutoscaleConfig

    size = FlagSet(
        FleetConfig,
        (
            Flag("min_replicas", help="active replicas at least (0: may scale to zero)"),
            Flag("max_replicas"),
            Flag("warm_standby", help="loaded replicas out of traffic, promoted at once"),
            Flag("scale_to_zero_after_s", names=("--scale-to-zero-after",), metavar="S"),
        ),
    )
    autoscale = FlagSet(
        AutoscaleConfig,
        (
            Flag("target_inflight", help="requests in flight per replica"),
            Flag("target_waiting", help="requests queued in the engine per replica"),
            Flag("target_kv_usage", help="mean KV-cache usage (0-1)"),
            Flag("target_ttft_s", names=("--target-ttft",), help="TTFT p90, seconds"),
            Flag("scale_up_delay_s", names=("--scale-up-delay",), metavar="S"),
            Flag("scale_down_delay_s", names=("--scale-down-delay",), metavar="S"),
        ),
    )
    disagg = FlagSet(
        GatewayConfig,
        (
            Flag(
                "disagg_min_prompt_tokens",
                help="prompts with fewer uncached tokens are prefilled on their decode worker",
            ),
        ),
    )
    return size, autoscale, disagg


def _override(config, args, flag_set: FlagSet) -> None:
    """The flags given, over what the config (a file's, or the defaults) holds."""
    for name, value in given(args, flag_set).items():
        setattr(config, name, value)


def _gateway_config(args):
    from shoal.fleet.config import FleetConfig, load_fleet_config

    try:
        fleet = load_fleet_config(args.config) if args.config else FleetConfig()
    except (OSError, ValueError, TypeError) as exc:  # a TOML syntax error is a ValueError
        print(f"shoal: {args.config}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    _override(fleet.gateway, args, gateway_flag_set())
    fleet.gateway.api_key = api_key_from(fleet.gateway.api_key)  # a key in argv is public
    return fleet


def _trace_refused(path: str | None) -> bool:
    """Whether --record-trace names a file that cannot be appended to (and says so)."""
    if path is None:
        return False
    try:
        with open(path, "a"):
            return False
    except OSError as exc:
        print(f"shoal: cannot record the trace to {path}: {exc.strerror or exc}", file=sys.stderr)
        return True


def _listen(cfg):
    """The gateway's socket, bound before anything of the fleet picks a free port of its own (the
    kernel would hand out the gateway's too, were it not held yet); cfg.port set to the port it got
    (--port 0 picks one). None after saying the port is taken."""
    from shoal.fleet.control.launchers.local import bind_listener

    sock = bind_listener(cfg.host, cfg.port)
    if sock is None:
        print(f"shoal: port {cfg.port} already in use; free it or choose another --port", file=sys.stderr)
        return None
    cfg.port = sock.getsockname()[1]
    return sock


def _run_gateway(gateway, what: str, sock) -> int:
    import uvicorn

    from shoal.fleet.graceful import GracefulServer
    from shoal.protocol import tracing

    cfg = gateway.config
    cfg.otlp_traces_endpoint = tracing.endpoint_from(cfg.otlp_traces_endpoint)
    tracing.configure("shoal-gateway", cfg.otlp_traces_endpoint)
    print(f"shoal: {what}; the API is at http://{cfg.host}:{cfg.port}/v1 (policy {cfg.policy})", flush=True)
    config = uvicorn.Config(
        gateway.build_app(),
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        timeout_graceful_shutdown=cfg.shutdown_timeout_s,
    )
    try:
        GracefulServer(config).run(sockets=[sock])
    finally:
        sock.close()
        tracing.shutdown()
    return 0


def fleet_config(args):
    """`shoal fleet up`'s FleetConfig: --config's file (or the defaults), then the flags given."""
    import shlex

    fleet = _gateway_config(args)
    size, autoscale, disagg = fleet_flag_sets()
    _override(fleet, args, size)
    _override(fleet.autoscale, args, autoscale)
    _override(fleet.gateway, args, disagg)
    if args.replicas is not None:
        fleet.replicas = args.replicas
    if args.prefill is not None or args.decode is not None:
        fleet.prefill, fleet.decode = args.prefill or 0, args.decode or 0
    fleet.model = args.model_pos or args.model or fleet.model
    if args.base_port is not None:
        fleet.base_port = args.base_port
    if args.cores_per_replica is not None:
        fleet.cores.per_replica = args.cores_per_replica
    if args.replica_args:
        fleet.replica_args = shlex.split(args.replica_args)
    return fleet


def cmd_fleet_up(args) -> int:
    from shoal.fleet.admission.store import shown
    from shoal.fleet.gateway import Gateway

    fleet = fleet_config(args)
    try:
        fleet.check()
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    fleet.gateway.tokenizer = fleet.gateway.tokenizer or fleet.model_configs()[0].model
    launcher = None
    if args.launcher == "ray":
        from shoal.fleet.control.launchers.ray import RayLauncher

        try:
            cpus = args.ray_cpus_per_replica or fleet.cores.per_replica or 1
            launcher = RayLauncher(args.address or "auto", cpus)
        except (RuntimeError, ConnectionError, ValueError) as exc:
            print(f"shoal: {exc}", file=sys.stderr)
            return 2
    if _trace_refused(fleet.gateway.record_trace):
        return 2
    sock = _listen(fleet.gateway)  # before the replicas' ports are chosen
    if sock is None:
        return 1
    gateway = Gateway(fleet.gateway, fleet, launcher)
    controller = gateway.controller
    # With a store, the fleet's replicas may run already: its leader's (this gateway adopts them
    # if it leads, and starts the rest).
    busy = controller.busy_ports() if gateway.leadership is None else []
    if busy:
        sock.close()
        print(
            f"shoal: port {', '.join(map(str, busy))} already in use (another fleet, or replicas left "
            "over from one?); free it or choose another --base-port",
            file=sys.stderr,
        )
        return 1
    names = ", ".join(f"{r.name} :{r.port}" for r in controller.slots)
    if gateway.leadership is not None:
        print(
            f"shoal: joining the fleet kept in {shown(fleet.gateway.store)}; its leader runs the replicas",
            flush=True,
        )
    else:
        print(
            f"shoal: starting {len(controller.slots)} replicas ({names}); logs in {controller.log_dir}",
            flush=True,
        )
    return _run_gateway(gateway, "fleet gateway up", sock)


def cmd_gateway(args) -> int:
    from shoal.fleet.gateway import Gateway

    fleet = _gateway_config(args)
    if args.backend:
        fleet.gateway.backends = args.backend
    if not fleet.gateway.backends:
        print("shoal: give at least one --backend URL (or backends in --config)", file=sys.stderr)
        return 2
    try:
        fleet.gateway.check()
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    if _trace_refused(fleet.gateway.record_trace):
        return 2
    sock = _listen(fleet.gateway)
    if sock is None:
        return 1
    return _run_gateway(Gateway(fleet.gateway), f"gateway over {len(fleet.gateway.backends)} backends", sock)


def _admin(args, method: str, path: str, body: dict | None = None):
    import httpx

    key = api_key_from(args.api_key)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.request(method, args.gateway.rstrip("/") + path, json=body, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        print(f"shoal: cannot reach the gateway at {args.gateway}: {exc}", file=sys.stderr)
        return None
    if resp.status_code >= 400:
        print(f"shoal: {resp.status_code}: {resp.text[:500]}", file=sys.stderr)
        return None
    return resp.json()


def cmd_fleet_update(args) -> int:
    import shlex

    body = {"model_name": args.model_name, "canary": args.canary, "canary_s": args.canary_seconds}
    if args.shadow is not None:
        body["shadow"] = args.shadow
    if args.model:
        body["model"] = args.model
    if args.replica_args is not None:
        body["replica_args"] = shlex.split(args.replica_args)
    out = _admin(args, "POST", "/fleet/update", body)
    if out is None:
        return 1
    print(f"shoal: rolling update started for {', '.join(out['updating'])}; `shoal fleet status` follows it")
    return 0


def cmd_fleet_status(args) -> int:
    out = _admin(args, "GET", "/replicas")
    if out is None:
        return 1
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    lead = out.get("leadership")
    if lead:
        role = "leads" if lead["leading"] else f"follows {lead['leader'] or '(no leader now)'}"
        print(f"gateway {lead['gateway']} {role}; {lead['gateways']} gateways alive")
    for p in out.get("pools", []):
        update = " (updating)" if p["updating"] else ""
        print(
            f"{p['pool']}: {p['desired']} desired in [{p['min']}, {p['max']}], {p['warm_standby']} warm, "
            f"version {p['version']}{update}; {p['decision'] or '-'}"
        )
        judged = p.get("judgement") or {}
        if judged.get("new"):
            print(f"  {judged.get('decision', 'judging')}: {_versions(judged)}")
    head = ("replica", "lifecycle", "health", "model", "inflight", "waiting", "kv")
    print("{:<16} {:<10} {:<10} {:<12} {:>8} {:>8} {:>6}".format(*head))
    for r in out["replicas"]:
        load = r.get("load") or {}
        kv = load.get("kv_usage")
        print(
            f"{r['name']:<16} {r.get('lifecycle', '-'):<10} {r['state']:<10} {r.get('model') or '-'!s:<12} "
            f"{r['inflight']:>8} {load.get('waiting', '-'):>8} {'-' if kv is None else f'{kv:.0%}':>6}"
        )
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def _versions(judged: dict) -> str:
    """A rolling update's figures, new against old, and the verdict if any."""

    def one(t: dict) -> str:
        return (
            f"{t['failed']}/{t['requests']} failed, TTFT p99 {_ms(t['ttft_p99_s'])}, "
            f"ITL p99 {_ms(t['itl_p99_s'])}"
        )

    verdict = f"; {judged['verdict']}" if judged.get("verdict") else ""
    return f"new {one(judged['new'])}; old {one(judged['old'])}{verdict}"


def cmd_fleet_usage(args) -> int:
    out = _admin(args, "GET", "/fleet/usage")
    if out is None:
        return 1
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    head = ("tenant", "lane", "requests", "prompt", "completion", "429s")
    print("{:<20} {:<12} {:>9} {:>12} {:>12} {:>6}".format(*head))
    for tenant, lanes in out["tenants"].items():
        for lane, u in lanes.items():
            print(
                f"{tenant:<20} {lane:<12} {u['requests']:>9} {u['prompt_tokens']:>12} "
                f"{u['completion_tokens']:>12} {u['rate_limited']:>6}"
            )
    return 0


def add_fleet_parsers(sub, full: bool = True) -> None:
    """`full`: with the flags generated from the fleet's config dataclasses (importing them)."""

    def gateway_args(p):
        p.add_argument(
            "--config", default=None, help="TOML file: replicas, model, [gateway] policy and limits"
        )
        if full:
            add_flags(p, gateway_flag_set())

    fleet = sub.add_parser("fleet", help="a gateway and local replicas").add_subparsers(
        dest="fleet", required=True
    )
    p = fleet.add_parser("up", help="start N local replicas behind one gateway, restarting any that die")
    p.add_argument("model_pos", nargs="?", metavar="MODEL")
    p.add_argument("--model", "-m", default=None)
    p.add_argument("--replicas", type=whole(1), default=None, help="a fixed fleet of this many")
    p.add_argument(
        "--prefill",
        type=whole(1),
        default=None,
        help="prefill workers (with --decode: a disaggregated fleet)",
    )
    p.add_argument("--decode", type=whole(1), default=None, help="decode workers (with --prefill)")
    if full:
        size, autoscale, disagg = fleet_flag_sets()
        add_flags(p, disagg)
        g = p.add_argument_group("autoscaling (without --min/--max-replicas, --replicas is a fixed fleet)")
        add_flags(g, size)
        add_flags(g, autoscale)
    p.add_argument("--base-port", type=int, default=None, help="replica ports from here (0: any free ports)")
    p.add_argument("--launcher", choices=["local", "ray"], default="local", help="where replicas run")
    p.add_argument("--address", default=None, help="the Ray cluster (--launcher ray): HOST:PORT, or auto")
    p.add_argument(
        "--cores-per-replica",
        type=whole(1),
        default=None,
        help="cores (and compute threads) each replica gets (default: the host's cores over the replicas)",
    )
    p.add_argument(
        "--ray-cpus-per-replica",
        type=POSITIVE,
        default=None,
        help="CPUs a replica's placement reserves (default: --cores-per-replica, else 1)",
    )
    p.add_argument(
        "--replica-args", default=None, help="extra `shoal serve` flags, e.g. '--kv-cache-memory 1GiB'"
    )
    gateway_args(p)
    p.set_defaults(func=cmd_fleet_up)

    p = sub.add_parser("gateway", help="front replicas that already run (shoal, vLLM, SGLang, llama.cpp)")
    p.add_argument("--backend", action="append", default=[], help="a replica's base URL (repeat)")
    gateway_args(p)
    p.set_defaults(func=cmd_gateway)

    for name, fn, what in (
        (
            "update",
            cmd_fleet_update,
            "roll a running fleet's replicas to a new model or flags, one at a time",
        ),
        ("status", cmd_fleet_status, "the fleet's pools and replicas"),
        ("usage", cmd_fleet_usage, "requests and tokens per tenant and lane, to bill from"),
    ):
        p = fleet.add_parser(name, help=what)
        p.add_argument("--gateway", default="http://127.0.0.1:8080", help="the fleet's gateway")
        p.add_argument("--api-key", default=None, help="the gateway's key (default $SHOAL_API_KEY)")
        if name == "update":
            p.add_argument("--model-name", default=None, help="which model, in a fleet of several")
            p.add_argument("--model", default=None, help="the new checkpoint")
            p.add_argument("--replica-args", default=None, help="the new `shoal serve` flags")
            p.add_argument(
                "--canary", type=fraction, default=0.0, help="share of requests to the first new replica"
            )
            p.add_argument(
                "--canary-seconds", type=NON_NEGATIVE, default=30.0, help="how long the canary is watched"
            )
            p.add_argument(
                "--shadow",
                type=fraction,
                default=None,
                help="share of requests also copied to the new version, compared and discarded; its "
                "first replica takes only copies for --canary-seconds (default: [rollout] shadow)",
            )
        else:
            p.add_argument("--json", action="store_true")
        p.set_defaults(func=fn)
