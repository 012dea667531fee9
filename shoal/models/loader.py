"""Resolves a model argument (None, a GGUF file, an HF directory) and loads model + tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.models.checkpoint import (  # noqa: F401  (re-exported: the historical home of these)
    BUNDLED_NAME,
    ModelNotFoundError,
    bundled_model_path,
    load_tokenizer,
    resolve_model,
)
from shoal.models.config import ModelConfig
from shoal.models.gguf_cache import load_cached, store
from shoal.models.gguf_loader import iter_gguf_blocks, iter_gguf_weights, load_gguf_config
from shoal.models.gguf_meta import open_gguf
from shoal.models.hf_loader import iter_hf_weights, load_hf_config
from shoal.models.llama import Communicator, LlamaForCausalLM
from shoal.models.parallel import ModelShard
from shoal.models.quant import BlockWeights, quantize_model, resolve_quantization, stored_projection_names
from shoal.models.sharded_read import take_blocks
from shoal.models.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    quantization: str | None = None  # what the weights run as: None (unquantized), "int8", "int4"


def load_model(
    model: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    quantization: str | None = "auto",
    parallel: tuple | None = None,
    comm: Communicator | None = None,
) -> LoadedModel:
    """quantization: "auto" (a GGUF's as stored, see `resolve_quantization`), "none" or None (the
    checkpoint's weights in `dtype`), "int8" or "int4" (see models.quant).

    parallel: (tp_rank, tp_size, pp_rank, pp_size[, expert_parallel, expert_all_to_all]) loads one
    rank's part of the model (see `ModelShard`), reading only its slices of the weights; `comm`
    joins its tensor-parallel peers."""
    name, path = resolve_model(model)
    stored: dict[str, BlockWeights] = {}
    shard: ModelShard | None = None
    if path.suffix == ".gguf":
        cached = load_cached(path, dtype)
        if cached is not None:
            cfg, tokenizer = cached.config, cached.tokenizer
            shard = ModelShard(cfg, *parallel) if parallel else None
            weights = None  # read once the model says which it needs
            quantization = resolve_quantization(quantization, cached.block_formats())
            if quantization == "int4":
                stored = cached.blocks(shard)
        else:
            cfg, tokenizer, converted, stored = _convert_gguf(path, dtype)
            quantization = resolve_quantization(quantization, {k: b.format for k, b in stored.items()})
            shard = ModelShard(cfg, *parallel) if parallel else ModelShard(cfg)
            weights = ((n, shard.take(n, t)) for n, t in converted.items() if shard.local_name(n))
            stored = {n: take_blocks(shard, n, b) for n, b in stored.items() if shard.local_name(n)}
    else:
        quantization = resolve_quantization(quantization, {})
        cfg = load_hf_config(path)
        tokenizer = Tokenizer.from_hf_dir(path)
        shard = ModelShard(cfg, *parallel) if parallel else None
        weights = iter_hf_weights(path, dtype, shard)
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, max_positions=max_positions, shard=shard, comm=comm)
    # Parameters are materialised empty and filled from the checkpoint: no random init cost.
    net = net.to_empty(device=device).to(dtype)
    net.rope.rebuild(device)  # buffers built on meta carry no values
    if shard is not None:  # stored blocks by the names this rank's model gives them
        stored = {shard.local_name(n): b for n, b in stored.items() if shard.local_name(n)}
    # int4 runs the projections a GGUF stores in blocks from those blocks: their float weights
    # would be read (most of a start's reading) only to be thrown away.
    left_out = (
        stored_projection_names(net, stored) if quantization == "int4" and weights is None else frozenset()
    )
    if weights is None:
        weights = cached.weights(shard, left_out)
    net.load_weights(((n, t.to(device)) for n, t in weights), left_out)
    net.eval().requires_grad_(False)
    if quantization is not None:
        quantize_model(net, quantization, {k: b.to(device) for k, b in stored.items()})
    return LoadedModel(
        name=name, path=path, config=cfg, model=net, tokenizer=tokenizer, quantization=quantization
    )


def describe_model(
    model: str | None = None, dtype: torch.dtype = torch.float32, quantization: str | None = "auto"
) -> LoadedModel:
    """Name, config, tokenizer and resolved quantization, without the weights (`model` is None):
    what an engine whose ranks load the weights needs. A GGUF's cache is written here, once, so
    that the ranks read their slices from it."""
    name, path = resolve_model(model)
    if path.suffix == ".gguf":
        cached = load_cached(path, dtype)
        if cached is not None:
            cfg, tokenizer, formats = cached.config, cached.tokenizer, cached.block_formats()
        else:  # first load: converted and cached (unless SHOAL_NO_CACHE, then each rank converts too)
            cfg, tokenizer, _, stored = _convert_gguf(path, dtype)
            formats = {k: b.format for k, b in stored.items()}
        quantization = resolve_quantization(quantization, formats)
    else:
        quantization = resolve_quantization(quantization, {})
        cfg, tokenizer = load_hf_config(path), Tokenizer.from_hf_dir(path)
    return LoadedModel(name, path, cfg, None, tokenizer, quantization)


def _convert_gguf(path: Path, dtype: torch.dtype):
    """(config, tokenizer, float weights, stored blocks) read from a GGUF, and written to its cache."""
    reader = open_gguf(path)
    cfg, tokenizer = load_gguf_config(reader), Tokenizer.from_gguf(reader)
    converted = dict(iter_gguf_weights(reader, cfg, dtype))
    stored = dict(iter_gguf_blocks(reader, cfg))
    store(path, dtype, cfg, tokenizer, converted, stored)
    return cfg, tokenizer, converted, stored
