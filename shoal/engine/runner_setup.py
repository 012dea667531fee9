"""Builds a model runner from the engine config: in the engine's process, or in each rank of a
tensor- or pipeline-parallel model."""

from __future__ import annotations

import logging

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.draft_proposer import DraftProposer
from shoal.engine.forward_paths import GraphOptions
from shoal.engine.kv_tiers import TierSpec
from shoal.engine.model_runner import ModelRunner, kv_bytes_per_block
from shoal.engine.parallel.comm import StageLink
from shoal.engine.speculative import NgramProposer, Proposer
from shoal.engine.structured import GrammarBackend
from shoal.models.config import ModelConfig
from shoal.models.loader import LoadedModel, load_model
from shoal.models.lora_layers import LoRASlots
from shoal.models.parallel import all_shards

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Decode batches up to this size replay CUDA graphs; larger ones are few and run eagerly.
MAX_GRAPH_ROWS = 256


def kv_dtype_of(config: EngineConfig) -> torch.dtype:
    kv = config.cache.kv_cache_dtype
    return DTYPES[config.dtype] if kv == "auto" else DTYPES[kv]


def pool_block_bytes(config: EngineConfig, mcfg: ModelConfig) -> int:
    """Bytes of one KV block on the largest rank: under tensor parallelism each rank's pool holds
    only its KV heads (under pipeline parallelism only its layers), and budgets are per rank."""
    p = config.parallel
    return max(
        kv_bytes_per_block(shard.local_config(), config.cache.block_size, kv_dtype_of(config))
        for shard in all_shards(
            mcfg, p.tensor_parallel_size, p.pipeline_parallel_size, p.expert_parallel_size > 1
        )
    )


def tier_spec(config: EngineConfig, mcfg: ModelConfig) -> TierSpec | None:
    """The KV offload tiers' sizes, alike in the scheduler's index and in every rank's store."""
    c = config.cache
    return TierSpec.of(
        c.kv_offload_memory, c.offload_disk_path, c.offload_disk_bytes, pool_block_bytes(config, mcfg)
    )


def build_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    num_blocks: int,
    max_model_len: int,
    stage: StageLink | None = None,
    device: str | None = None,
) -> ModelRunner:
    device = device or config.device
    graphs = lora = None
    if config.lora.enable_lora:
        # Before the forward paths are chosen (the fused C layer reads the wrapped projections'
        # slots). No CUDA graphs: a step's rows change adapters.
        dtype = config.lora.weights_dtype(loaded.model.dtype, loaded.quantization is not None)
        lora = LoRASlots(loaded.model, config.lora.max_loras, config.lora.max_lora_rank, dtype)
    elif not config.enforce_eager and config.parallel.world_size == 1:
        graphs = GraphOptions(min(config.scheduler.max_num_seqs, MAX_GRAPH_ROWS), max_model_len)
    tokenizer = loaded.tokenizer
    eos = tokenizer.eos_token_ids
    vocab = loaded.config.vocab_size
    grammars = GrammarBackend(tokenizer.backend, vocab, sorted(eos))
    proposer = _proposer(config, loaded, num_blocks, max_model_len, device)
    return ModelRunner(
        loaded.model,
        num_blocks,
        config.cache.block_size,
        eos,
        device,
        graphs,
        kv_dtype_of(config),
        grammars,
        proposer,
        config.speculative.max_batch,
        stage,
        lora,
        tier_spec(config, loaded.config) if config.cache.enable_prefix_caching else None,
        {"auto": None, "on": True, "off": False}[config.decode_ahead],
    )


def _proposer(
    config: EngineConfig, loaded: LoadedModel, num_blocks: int, max_model_len: int, device: str
) -> Proposer | None:
    spec = config.speculative
    spec.check()
    if spec.speculative == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.ngram_max, spec.ngram_min)
    if spec.speculative != "draft":
        return None
    draft = load_model(
        spec.speculative_model or config.model,
        dtype=DTYPES[config.dtype],
        device=device,
        quantization=spec.speculative_quantization,
    )
    if draft.config.vocab_size != loaded.config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.config.vocab_size}) is not the target's "
            f"({loaded.config.vocab_size}): they must share a tokenizer"
        )
    log.info("draft model %s: weights %s", draft.name, draft.quantization or config.dtype)
    runner = ModelRunner(
        draft.model, num_blocks, config.cache.block_size, loaded.tokenizer.eos_token_ids, device
    )
    return DraftProposer(runner, spec.num_speculative_tokens, max_model_len)
