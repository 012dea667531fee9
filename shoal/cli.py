"""The `shoal` command."""

from __future__ import annotations

import argparse
import sys

from shoal.cli_bench import add_bench_parsers
from shoal.cli_flags import add_flags, build
from shoal.cli_fleet import add_fleet_parsers
from shoal.cli_index import add_index_parsers
from shoal.cli_options import (
    add_engine_args,
    add_sampling_args,
    engine_options,
    sampling_params,
    serve_flag_sets,
)
from shoal.cli_sim import add_sim_parsers
from shoal.cli_types import whole
from shoal.protocol.secrets import api_key_from


def _make_llm(args):
    from shoal.llm import LLM

    return LLM(args.model, **engine_options(args))


def cmd_generate(args) -> int:
    params = sampling_params(args)  # checked before the model loads
    with _make_llm(args) as llm:  # the exit stops a parallel engine's ranks
        for prompt in args.prompt:
            sys.stdout.write(prompt)
            for piece in llm.stream(prompt, params):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    params = sampling_params(args)  # checked before the model loads
    with _make_llm(args) as llm:
        return _chat(llm, args, params)


def _chat(llm, args, params) -> int:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})

    def answer(user_text: str) -> None:
        messages.append({"role": "user", "content": user_text})
        ids = llm.tokenizer.encode_chat(messages)
        reply = []
        for piece in llm.stream(ids, params):
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
    model = args.model_pos or args.model
    options = {"enable_kv_events": True, **engine_options(args)}  # a fleet router may subscribe
    try:  # every config's own checks, before the model loads
        server = build(args, server_flags, front=build(args, front_flags), kv=build(args, kv_flags))
        engine = build_engine_config(model, **options)
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    server.api_key = api_key_from(server.api_key)  # a key in argv is public: $SHOAL_API_KEY is not
    return serve(engine, server)


def cmd_worker(args) -> int:
    from shoal.engine.parallel.worker import main

    advertise = ["--advertise-host", args.advertise_host] if args.advertise_host else []
    return main(["--driver", args.driver, "--rank", str(args.rank), *advertise])


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with `command` the options of that subcommand only: the engine's and
    the server's flags come from their config dataclasses, whose modules import torch, and a
    `shoal fleet` command has no use for either."""
    parser = argparse.ArgumentParser(prog="shoal", description="Serve large language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    def wanted(name: str) -> bool:  # name: a command, or a command and its subcommand
        return command is None or f"{command} ".startswith(f"{name} ")

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
    p.add_argument("--rank", type=whole(0), required=True)
    p.add_argument(
        "--advertise-host",
        default=None,
        help="the address other ranks reach this one at (default: the route to the driver)",
    )
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

    add_bench_parsers(sub, wanted)
    add_index_parsers(sub)
    add_sim_parsers(sub, wanted)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = " ".join([a for a in argv if not a.startswith("-")][:2])  # "": none, build no options
    args = build_parser(command).parse_args(argv)
    args.argv = argv  # as typed: `shoal profile` passes its engine flags on to the server it starts
    from shoal.engine.sampling_params import InvalidParamError
    from shoal.models.checkpoint import ModelNotFoundError

    try:
        return args.func(args)
    except (ModelNotFoundError, InvalidParamError) as e:
        print(f"shoal: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
