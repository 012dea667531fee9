"""The `shoal` command's shared options: engine, speculative decoding and sampling flags, and
the engine options and SamplingParams they stand for."""

from __future__ import annotations

import argparse
import re
from typing import Any

_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'2GiB', '512M', '1073741824' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB or 512MiB)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV pool budget, e.g. 2GiB")
    g.add_argument(
        "--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides the budget)"
    )
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "float32", "float16", "bfloat16"],
        help="KV cache element type; auto: the model's. 16 bits: half the attention reads, twice the tokens",
    )
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None)
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps (slower)"
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["auto", "none", "int8", "int4"],
        help="auto (default): a GGUF runs as stored (int4 for Q4 files, int8 for Q8), other "
        "checkpoints unquantized; none: unquantized, the fp32 reference; int8: per-channel int8 "
        "weights; int4: 4-bit blocks, a GGUF's own Q4/Q8 tensors as stored",
    )
    add_speculative_args(g)
    add_parallel_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel (one model across processes)")
    g.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=None, help="ranks each layer is split across"
    )
    g.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=None, help="stages the layers are split into"
    )
    g.add_argument(
        "--distributed-host", default=None, help="address the ranks reach this process at (127.0.0.1)"
    )
    g.add_argument(
        "--distributed-port", type=int, default=None, help="rank connections here, rendezvous at +1 (0: free)"
    )
    g.add_argument(
        "--external-workers",
        action="store_true",
        help="start no ranks here: each connects from its host with `shoal worker` (SHOAL_WORKER_AUTHKEY)",
    )
    g.add_argument(
        "--rank-timeout",
        type=float,
        default=None,
        help="seconds a rank may take for a step before it is dead",
    )


def add_speculative_args(g) -> None:
    g.add_argument(
        "--speculative",
        default=None,
        choices=["ngram", "draft"],
        help="speculative decoding: ngram (prompt lookup) or draft (a small model proposes)",
    )
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="tokens proposed a step (4)")
    g.add_argument(
        "--speculative-model", default=None, help="draft: its checkpoint (default: the target's own)"
    )
    g.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="no proposals while more requests than this sample together (default: draft 4, ngram none)",
    )
    g.add_argument(
        "--speculative-quantization",
        default=None,
        choices=["auto", "none", "int8", "int4"],
        help="draft: how its weights run (default int4)",
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    names = [
        "speculative",
        "num_speculative_tokens",
        "speculative_model",
        "speculative_quantization",
        "speculative_disable_by_batch_size",
        "kv_cache_memory",
        "num_blocks",
        "block_size",
        "kv_cache_dtype",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "dtype",
        "device",
        "quantization",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "distributed_host",
        "distributed_port",
    ]
    opts = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if getattr(args, "external_workers", False):
        opts["launch_workers"] = False
    if getattr(args, "rank_timeout", None) is not None:
        opts["step_timeout_s"] = args.rank_timeout
    if args.no_prefix_caching:
        opts["enable_prefix_caching"] = False
    if args.threads:
        opts["num_threads"] = args.threads
    if getattr(args, "enforce_eager", False):
        opts["enforce_eager"] = True
    return opts


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
