"""The `shoal` command."""

from __future__ import annotations

import argparse
import sys

from shoal.cli_fleet import add_fleet_parsers
from shoal.cli_options import add_engine_args, add_sampling_args, engine_options, parse_size, sampling_params
from shoal.protocol.secrets import api_key_from


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
    from shoal.engine.async_engine import AsyncEngineConfig
    from shoal.llm import build_engine_config
    from shoal.server.kv_connector import KVConnectorConfig
    from shoal.server.launch import ServerConfig, serve

    model = args.model_pos or args.model
    try:
        kv = KVConnectorConfig(
            role=args.role,
            transport=args.kv_transport,
            transfer_timeout_s=args.kv_transfer_timeout,
            hold_timeout_s=args.kv_hold_timeout,
        )
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    front = AsyncEngineConfig(
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens,
        stall_timeout_s=args.stall_timeout,
    )
    server = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=api_key_from(args.api_key),
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        front=front,
        trust_request_priority=args.trust_request_priority,
        kv_salt=args.kv_salt,
        tool_call_parser=args.tool_call_parser,
        kv=kv,
    )
    if args.max_request_bytes:
        server.max_request_bytes = args.max_request_bytes
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
        api_key=api_key_from(args.api_key),
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
        api_key=api_key_from(args.api_key),
        json_path=args.json,
    )
    return 0 if run_multiturn(cfg)["completed"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Serve large language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the OpenAI API over HTTP")
    p.add_argument(
        "model_pos", nargs="?", metavar="MODEL", help="GGUF file or HF directory (default: bundled)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the API routes (default: $SHOAL_API_KEY)",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: its name)")
    p.add_argument("--max-waiting-requests", type=int, default=256, help="past this queue, answer 503")
    p.add_argument("--max-waiting-tokens", type=int, default=262_144, help="prompt tokens queued before 503")
    p.add_argument("--stall-timeout", type=float, default=60.0, help="a step longer than this is unhealthy")
    p.add_argument(
        "--max-request-bytes", type=parse_size, default=None, help="larger bodies get 413 (default 4MiB)"
    )
    p.add_argument(
        "--trust-request-priority",
        action="store_true",
        help="take a request's `priority` as given (else a client can only lower its own priority)",
    )
    p.add_argument(
        "--kv-salt",
        default=None,
        help="secret salt of the KV block hashes (default: $SHOAL_KV_SALT, else from the key)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "smollm2", "hermes", "llama3_json"],
        help="how the model writes tool calls; auto: the format its chat template uses (SmolLM2's "
        "own where the template has no tools)",
    )
    p.add_argument("--log-level", default="warning")
    g = p.add_argument_group("prefill/decode disaggregation (the K/V key comes from $SHOAL_KV_TRANSFER_KEY)")
    g.add_argument(
        "--role",
        choices=["both", "prefill", "decode"],
        default="both",
        help="what a disaggregating gateway sends here: prompts to prefill, or generation",
    )
    g.add_argument("--kv-transport", choices=["auto", "shm", "tcp", "nixl"], default="auto")
    g.add_argument(
        "--kv-transfer-timeout", type=float, default=10.0, help="seconds before a K/V pull is given up"
    )
    g.add_argument(
        "--kv-hold-timeout", type=float, default=30.0, help="seconds a prefilled K/V waits to be pulled"
    )
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    add_fleet_parsers(sub)

    p = sub.add_parser("worker", help="one rank of a tensor/pipeline-parallel engine, on another host")
    p.add_argument("--driver", required=True, help="HOST:PORT of the engine (its --distributed-port)")
    p.add_argument("--rank", type=int, required=True)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("generate", help="complete prompts, streaming to the terminal")
    p.add_argument("prompt", nargs="+")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the model (one answer with PROMPT, else interactive)")
    p.add_argument("prompt", nargs="?")
    p.add_argument("--system", default=None)
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
    args = build_parser().parse_args(argv)
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
