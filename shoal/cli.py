"""The `shoal` command."""

from __future__ import annotations

import argparse
import sys

from shoal.cli_flags import add_flags, build
from shoal.cli_fleet import add_fleet_parsers
from shoal.cli_options import (
    add_engine_args,
    add_sampling_args,
    engine_options,
    sampling_params,
    serve_flag_sets,
)


def _make_llm(args):
    from shoal.llm import LLM

    return LLM(args.model, **engine_options(args))


def cmd_generate(args) -> int:
    with _make_llm(args) as llm:  # the exit stops a parallel engine's ranks
        for prompt in args.prompt:
            sys.stdout.write(prompt)
            for piece in llm.stream(prompt, sampling_params(args)):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    with _make_llm(args) as llm:
        return _chat(llm, args)


def _chat(llm, args) -> int:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})

    def answer(user_text: str) -> None:
        messages.append({"role": "user", "content": user_text})
        ids = llm.tokenizer.encode_chat(messages)
        reply = []
        for piece in llm.stream(ids, sampling_params(args)):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})

    if args.prompt:
        answer(args.prompt)
        return 0
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip():
            answer(line)


def cmd_serve(args) -> int:
    from shoal.llm import build_engine_config
    from shoal.server.launch import serve

    server_flags, front_flags, kv_flags = serve_flag_sets()
    try:
        kv = build(args, kv_flags)
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    server = build(args, server_flags, front=build(args, front_flags), kv=kv)
    model = args.model_pos or args.model
    options = {"enable_kv_events": True, **engine_options(args)}  # a fleet router may subscribe
    return serve(build_engine_config(model, **options), server)


def cmd_worker(args) -> int:
    from shoal.engine.parallel.worker import main

    return main(["--driver", args.driver, "--rank", str(args.rank)])


def cmd_bench_offline(args) -> int:
    from shoal.bench.offline import OfflineBenchConfig, run_offline_bench

    cfg = OfflineBenchConfig(
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        input_len_range=tuple(args.input_len_range) if args.input_len_range else None,
        output_len_range=tuple(args.output_len_range) if args.output_len_range else None,
        seed=args.seed,
        compare_hf=args.compare_hf,
        hf_batch_size=args.hf_batch_size,
        json_path=args.json,
    )
    run_offline_bench(cfg, args.model, engine_options(args))
    return 0


def cmd_bench_serve(args) -> int:
    from shoal.bench.serve import ServeBenchConfig, run_serve_bench

    cfg = ServeBenchConfig(
        base_url=args.base_url.rstrip("/").removesuffix("/v1"),
        model=args.model,
        tokenizer=args.tokenizer,
        endpoint=args.endpoint,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        dataset=args.dataset,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        ignore_eos=not args.respect_eos,
        seed=args.seed,
        api_key=args.api_key,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        json_path=args.json,
        plot_path=args.plot,
    )
    summary = run_serve_bench(cfg)
    return 0 if summary["completed"] else 1


def cmd_bench_multiturn(args) -> int:
    from shoal.bench.multiturn import MultiTurnConfig, run_multiturn

    cfg = MultiTurnConfig(
        base_url=args.base_url.rstrip("/").removesuffix("/v1"),
        model=args.model,
        tokenizer=args.tokenizer,
        conversations=args.conversations,
        turns=args.turns,
        system_len=args.system_len,
        first_len=args.first_len,
        followup_len=args.followup_len,
        output_len=args.output_len,
        seed=args.seed,
        api_key=args.api_key,
        json_path=args.json,
    )
    return 0 if run_multiturn(cfg)["completed"] else 1


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with `command` the options of that subcommand only: the engine's and
    the server's flags come from their config dataclasses, whose modules import torch, and a
    `shoal fleet` command has no use for either."""
    parser = argparse.ArgumentParser(prog="shoal", description="Serve large language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    def wanted(name: str) -> bool:
        return command is None or command == name

    p = sub.add_parser("serve", help="serve the OpenAI API over HTTP")
    p.add_argument(
        "model_pos", nargs="?", metavar="MODEL", help="GGUF file or HF directory (default: bundled)"
    )
    if wanted("serve"):
        server_flags, front_flags, kv_flags = serve_flag_sets()
        add_flags(p, server_flags)
        add_flags(p, front_flags)
        disagg = "prefill/decode disaggregation (the K/V key comes from $SHOAL_KV_TRANSFER_KEY)"
        add_flags(p.add_argument_group(disagg), kv_flags)
        add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    add_fleet_parsers(sub, full=wanted("fleet") or wanted("gateway"))

    p = sub.add_parser("worker", help="one rank of a tensor/pipeline-parallel engine, on another host")
    p.add_argument("--driver", required=True, help="HOST:PORT of the engine (its --distributed-port)")
    p.add_argument("--rank", type=int, required=True)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("generate", help="complete prompts, streaming to the terminal")
    p.add_argument("prompt", nargs="+")
    if wanted("generate"):
        add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the model (one answer with PROMPT, else interactive)")
    p.add_argument("prompt", nargs="?")
    p.add_argument("--system", default=None)
    if wanted("chat"):
        add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("offline", help="offline engine throughput, optionally against HF transformers")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len-range", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compare-hf", action="store_true", help="also run HF transformers generate, same prompts"
    )
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--json", default=None, help="write the results here")
    if wanted("bench"):
        add_engine_args(p)
    p.set_defaults(func=cmd_bench_offline)

    p = bench.add_parser("serve", help="load an OpenAI-compatible endpoint; latency and throughput")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    p.add_argument("--tokenizer", default=None, help="checkpoint whose tokenizer sizes the prompts")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset", default=None, help="JSON or JSONL of conversations")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--respect-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG of latency over time and CDFs")
    p.set_defaults(func=cmd_bench_serve)

    p = bench.add_parser(
        "multiturn", help="multi-turn chat load: shared system prompt, growing conversations"
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-len", type=int, default=200)
    p.add_argument("--first-len", type=int, default=300, help="tokens in each conversation's opening message")
    p.add_argument("--followup-len", type=int, default=40)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_bench_multiturn)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), "")  # "": none given, build no options
    args = build_parser(command).parse_args(argv)
    from shoal.models.checkpoint import ModelNotFoundError

    try:
        return args.func(args)
    except ModelNotFoundError as e:
        print(f"shoal: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
