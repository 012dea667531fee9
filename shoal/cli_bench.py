"""`shoal bench offline|serve|multiturn`: the benchmarks' commands, their flags generated from the
benchmarks' config dataclasses."""

from __future__ import annotations

import dataclasses
import sys

from shoal.cli_flags import Flag, FlagSet, add_flags, build
from shoal.cli_options import add_engine_args, engine_options
from shoal.cli_workload import burst_flag
from shoal.protocol.secrets import api_key_from

JSON_OUT = Flag("json_path", names=("--json",), help="write the results here")


def offline_flag_set() -> FlagSet:
    from shoal.bench.offline import OfflineBenchConfig

    return FlagSet(
        OfflineBenchConfig,
        (
            Flag("num_requests"),
            Flag("input_len"),
            Flag("output_len"),
            Flag("input_len_range", nargs=2, parse=int, metavar=("MIN", "MAX")),
            Flag("output_len_range", nargs=2, parse=int, metavar=("MIN", "MAX")),
            Flag("seed"),
            Flag("compare_hf", help="also run HF transformers generate, same prompts"),
            Flag("hf_batch_size"),
            JSON_OUT,
        ),
    )


def serve_bench_flag_set() -> FlagSet:
    from shoal.bench.serve import ServeBenchConfig

    return FlagSet(
        ServeBenchConfig,
        (
            Flag("base_url"),
            Flag("model", help="model id to request (default: the server's first)"),
            Flag("tokenizer", help="checkpoint whose tokenizer sizes the prompts"),
            Flag("endpoint", choices=("completions", "chat")),
            Flag("num_requests"),
            Flag("input_len"),
            Flag("output_len"),
            Flag(
                "input_len_range",
                nargs=2,
                parse=int,
                metavar=("MIN", "MAX"),
                help="each prompt's tokens drawn uniformly from MIN to MAX (instead of --input-len)",
            ),
            Flag("output_len_range", nargs=2, parse=int, metavar=("MIN", "MAX"), help="as --input-len-range"),
            Flag("dataset", help="JSON or JSONL of conversations"),
            Flag("request_rate", help="Poisson arrivals per second"),
            Flag(
                "bursts",
                names=("--burst",),
                nargs="+",
                parse=burst_flag,
                metavar="START:LENGTH:FACTOR",
                help="spells of FACTOR x the rate, LENGTH seconds from START seconds into the run",
            ),
            Flag("max_concurrency"),
            Flag("ignore_eos", names=("--respect-eos",), negate=True, help="let requests stop at EOS"),
            Flag("seed"),
            Flag("api_key"),
            Flag("slo_ttft_ms"),
            Flag("slo_tpot_ms"),
            JSON_OUT,
            Flag("plot_path", names=("--plot",), help="write a PNG of latency over time and CDFs"),
        ),
    )


def multiturn_flag_set() -> FlagSet:
    from shoal.bench.multiturn import MultiTurnConfig

    return FlagSet(
        MultiTurnConfig,
        (
            Flag("base_url"),
            Flag("model"),
            Flag("tokenizer"),
            Flag("conversations"),
            Flag("turns"),
            Flag("system_len"),
            Flag("first_len", help="tokens in each conversation's opening message"),
            Flag("followup_len"),
            Flag("output_len"),
            Flag("seed"),
            Flag("api_key"),
            JSON_OUT,
        ),
    )


def _endpoint(cfg):
    """The server's root, however its URL was given (with /v1, or a trailing slash); the key from
    $SHOAL_API_KEY when no flag gives it."""
    root = cfg.base_url.rstrip("/").removesuffix("/v1")
    return dataclasses.replace(cfg, base_url=root, api_key=api_key_from(cfg.api_key))


def cmd_bench_offline(args) -> int:
    from shoal.bench.offline import run_offline_bench

    run_offline_bench(build(args, offline_flag_set()), args.model, engine_options(args))
    return 0


def cmd_bench_serve(args) -> int:
    from shoal.bench.serve import run_serve_bench

    try:
        cfg = build(args, serve_bench_flag_set())
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    summary = run_serve_bench(_endpoint(cfg))
    return 0 if summary["completed"] else 1


def cmd_bench_multiturn(args) -> int:
    from shoal.bench.multiturn import run_multiturn

    return 0 if run_multiturn(_endpoint(build(args, multiturn_flag_set())))["completed"] else 1


def add_bench_parsers(sub, wanted) -> None:
    """`wanted(name)`: whether to build that command's options (they import its module)."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("offline", help="offline engine throughput, optionally against HF transformers")
    if wanted("bench offline"):
        add_flags(p, offline_flag_set())
        add_engine_args(p)
    p.set_defaults(func=cmd_bench_offline)

    p = bench.add_parser("serve", help="load an OpenAI-compatible endpoint; latency and throughput")
    if wanted("bench serve"):
        add_flags(p, serve_bench_flag_set())
    p.set_defaults(func=cmd_bench_serve)

    p = bench.add_parser(
        "multiturn", help="multi-turn chat load: shared system prompt, growing conversations"
    )
    if wanted("bench multiturn"):
        add_flags(p, multiturn_flag_set())
    p.set_defaults(func=cmd_bench_multiturn)
