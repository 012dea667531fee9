"""The `shoal` command's shared options: engine, speculative decoding and sampling flags, and
the engine options and SamplingParams they stand for. The engine's flags are generated from its
config dataclasses (cli_flags), so their defaults are the dataclasses' own."""

from __future__ import annotations

import argparse
from typing import Any

from shoal.cli_flags import Flag, FlagSet, add_flags, given
from shoal.protocol.sizes import format_size, parse_size

QUANTIZATIONS = ("auto", "none", "int8", "int4")


def engine_flag_sets() -> tuple[FlagSet, ...]:
    """The engine's flags (`serve`, `generate`, `chat`, `bench offline`), from its config dataclasses.
    Imported here, not at the top: they import torch, which the fleet's commands do without."""
    from shoal.engine.config import DECODE_AHEAD, CacheConfig, EngineConfig, SchedulerConfig
    from shoal.engine.lora_manager import LoRAConfig, parse_lora_module
    from shoal.engine.speculative import SpeculativeConfig

    cache = FlagSet(
        CacheConfig,
        (
            Flag("kv_cache_memory", help="KV pool budget", parse=parse_size, show=format_size),
            Flag("num_blocks", help="KV pool size in blocks (overrides the budget)"),
            Flag("block_size"),
            Flag(
                "kv_cache_dtype",
                choices=("auto", "float32", "float16", "bfloat16"),
                help="KV cache element type; auto: the model's. 16 bits: half the attention reads, "
                "twice the tokens",
            ),
            Flag(
                "kv_offload_memory",
                parse=parse_size,
                show=format_size,
                help="host memory for prefix blocks evicted from the pool (0: none)",
            ),
            Flag(
                "kv_offload_disk",
                nargs=2,
                parse=str,
                metavar=("PATH", "SIZE"),
                show=lambda _: "none",
                help="a folder on local disk for evicted prefix blocks, up to SIZE bytes",
            ),
            Flag(
                "enable_prefix_caching",
                names=("--no-prefix-caching",),
                negate=True,
                help="compute every prompt whole (no reuse of cached prefixes)",
            ),
        ),
    )
    scheduler = FlagSet(
        SchedulerConfig,
        (
            Flag("max_num_seqs"),
            Flag("max_num_batched_tokens"),
            Flag("max_model_len", help="default: the model's context length, as the KV pool allows"),
        ),
    )
    engine = FlagSet(
        EngineConfig,
        (
            Flag("dtype", choices=("float32", "bfloat16", "float16")),
            Flag("device"),
            Flag("num_threads", names=("--threads",), help="torch intra-op threads"),
            Flag("enforce_eager", help="CUDA: no CUDA graphs for decode steps (slower)"),
            Flag(
                "decode_ahead",
                choices=DECODE_AHEAD,
                help="queue each greedy decode step's successor before reading its tokens, so host "
                "work overlaps the device's; auto: with CUDA graphs",
            ),
            Flag(
                "quantization",
                names=("--quantization", "-q"),
                choices=QUANTIZATIONS,
                help="auto: a GGUF runs as stored (int4 for Q4 files, int8 for Q8), other checkpoints "
                "unquantized; none: unquantized, the fp32 reference; int8: per-channel int8 weights; "
                "int4: 4-bit blocks, a GGUF's own Q4/Q8 tensors as stored",
            ),
        ),
    )
    speculative = FlagSet(
        SpeculativeConfig,
        (
            Flag(
                "speculative",
                choices=("ngram", "draft"),
                help="speculative decoding: ngram (prompt lookup) or draft (a small model proposes)",
            ),
            Flag("num_speculative_tokens", help="tokens proposed a step"),
            Flag("speculative_model", help="draft: its checkpoint (default: the target's own)"),
            Flag(
                "speculative_disable_by_batch_size",
                help="no proposals while more requests than this sample together (default: draft 4, "
                "ngram none)",
            ),
            Flag("speculative_quantization", choices=QUANTIZATIONS, help="draft: how its weights run"),
        ),
    )
    lora = FlagSet(
        LoRAConfig,
        (
            Flag("enable_lora", help="serve LoRA adapters (PEFT folders) over the base model"),
            Flag(
                "lora_modules",
                parse=parse_lora_module,
                nargs="+",
                metavar="NAME=PATH",
                help="adapters served from the start; a request names one as its model",
            ),
            Flag("max_loras", help="adapters resident at once (their slots come out of the KV budget)"),
            Flag("max_lora_rank", help="the largest adapter rank a slot holds"),
            Flag(
                "lora_dtype",
                choices=("auto", "float32", "float16"),
                help="adapter weights' type (auto: the model's; float16 over an int4 or int8 base)",
            ),
        ),
    )
    return cache, scheduler, engine, speculative, lora


def parallel_flag_set() -> FlagSet:
    from shoal.engine.config import EXPERT_DISPATCH, ParallelConfig

    return FlagSet(
        ParallelConfig,
        (
            Flag(
                "tensor_parallel_size",
                names=("--tensor-parallel-size", "-tp"),
                help="ranks each layer is split across",
            ),
            Flag(
                "pipeline_parallel_size",
                names=("--pipeline-parallel-size", "-pp"),
                help="stages the layers are split into",
            ),
            Flag(
                "expert_parallel_size",
                names=("--expert-parallel-size", "-ep"),
                help="ranks a mixture of experts' experts are split across (its attention by heads)",
            ),
            Flag(
                "expert_dispatch",
                choices=EXPERT_DISPATCH,
                help="how tokens reach their experts' ranks: every rank routes all and an all-reduce "
                "combines, or each routes its share and trades them by all-to-all",
            ),
            Flag(
                "expert_spare_slots",
                help="replicas of other ranks' experts a rank may hold per layer, to even out the load",
            ),
            Flag("expert_rebalance_steps", help="steps a window of expert load is counted over"),
            Flag("distributed_host", help="address the ranks reach this process at"),
            Flag("distributed_port", help="rank connections here, rendezvous at +1 (0: free)"),
            Flag(
                "launch_workers",
                names=("--external-workers",),
                negate=True,
                help="start no ranks here: each connects from its host with `shoal worker` "
                "(SHOAL_WORKER_AUTHKEY)",
            ),
            Flag(
                "step_timeout_s",
                names=("--rank-timeout",),
                help="seconds a rank may take for a step before it is dead",
            ),
        ),
    )


def serve_flag_sets() -> tuple[FlagSet, FlagSet, FlagSet]:
    """`shoal serve`'s own flags: the server, its async front and its K/V handoff."""
    from shoal.engine.async_engine import AsyncEngineConfig
    from shoal.engine.kv_connector.transports import TRANSPORTS
    from shoal.models.tool_formats import FORMATS
    from shoal.server.kv_connector import ROLES, KVConnectorConfig
    from shoal.server.launch import ServerConfig

    server = FlagSet(
        ServerConfig,
        (
            Flag("host"),
            Flag("port"),
            Flag(
                "api_key",
                help="require 'Authorization: Bearer KEY' on the API routes (default: $SHOAL_API_KEY)",
            ),
            Flag("served_model_name", help="the model id clients send (default: its name)"),
            Flag("max_request_bytes", parse=parse_size, show=format_size, help="larger bodies get 413"),
            Flag(
                "trust_request_priority",
                help="take a request's `priority` as given (else a client can only lower its own priority)",
            ),
            Flag(
                "kv_salt",
                help="secret salt of the KV block hashes (default: $SHOAL_KV_SALT, else from the key)",
            ),
            Flag(
                "tool_call_parser",
                choices=("auto", *FORMATS),
                help="how the model writes tool calls; auto: the format its chat template uses (SmolLM2's "
                "own where the template has no tools)",
            ),
            Flag(
                "embedding_pooling",
                choices=("auto", "mean", "last"),
                help="how /v1/embeddings pools the final hidden states: the mean over the prompt, "
                "the last token's, or auto: as the checkpoint says (sentence-transformers' pooling "
                "config, GGUF pooling_type), else last",
            ),
            Flag("log_level"),
            Flag(
                "peer_timeout_s",
                names=("--peer-timeout",),
                help="seconds a connection may leave data unacknowledged before it is dropped and its "
                "requests aborted (a client cut off; 0: the kernel's default, many minutes)",
            ),
            Flag(
                "shutdown_timeout_s",
                names=("--shutdown-timeout",),
                help="on SIGTERM, seconds the requests in flight get to finish while new ones are "
                "refused (503, code draining); then it exits",
            ),
            Flag(
                "otlp_traces_endpoint",
                metavar="URL",
                help="export OpenTelemetry spans over OTLP/HTTP to URL, e.g. http://collector:4318/v1/traces "
                "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; none: off)",
            ),
        ),
    )
    front = FlagSet(
        AsyncEngineConfig,
        (
            Flag("max_waiting_requests", help="past this queue, answer 503"),
            Flag("max_waiting_tokens", help="prompt tokens queued before 503"),
            Flag("stall_timeout_s", names=("--stall-timeout",), help="a step longer than this is unhealthy"),
        ),
    )
    kv = FlagSet(
        KVConnectorConfig,
        (
            Flag(
                "role",
                choices=ROLES,
                help="what a disaggregating gateway sends here: prompts to prefill, or generation",
            ),
            Flag("transport", names=("--kv-transport",), choices=TRANSPORTS),
            Flag(
                "transfer_timeout_s",
                names=("--kv-transfer-timeout",),
                help="seconds before a K/V pull is given up",
            ),
            Flag(
                "hold_timeout_s",
                names=("--kv-hold-timeout",),
                help="seconds a prefilled K/V waits to be pulled",
            ),
        ),
    )
    return server, front, kv


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    for flag_set in engine_flag_sets():
        add_flags(g, flag_set)
    add_flags(p.add_argument_group("parallel (one model across processes)"), parallel_flag_set())


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line, by config field (see llm.build_engine_config)."""
    options: dict[str, Any] = {}
    for flag_set in (*engine_flag_sets(), parallel_flag_set()):
        options.update(given(args, flag_set))
    return options


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from shoal.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
