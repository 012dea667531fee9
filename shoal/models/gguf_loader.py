"""Loads GGUF files through the `gguf` package: config from metadata, tensors dequantized, and the
blocks of the quantized tensors that shoal can compute with as stored."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from shoal.models.config import ModelConfig, RopeScaling
from shoal.models.gguf_meta import field_value, open_gguf  # noqa: F401  (open_gguf re-exported)
from shoal.models.pooling_config import gguf_pooling
from shoal.models.quant import BlockWeights

# GGUF architecture name -> ours. Mistral files are written with the llama architecture, and so
# are Mixtral's (with experts).
_ARCHS = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
}
# Whether the router's top-k weights are renormalised, where a file does not say
# (expert_weights_norm): as llama.cpp builds each architecture.
_NORM_TOPK = {"mixtral": True, "qwen3_moe": True}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A layer's experts stacked in one tensor [experts, rows, cols]: HF's name of one expert's part.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def hf_expert_names(gguf_name: str, experts: int) -> list[str] | None:
    """The HF name of each expert's slice of a stacked expert tensor (None: not one)."""
    m = _LAYER_RE.match(gguf_name)
    if not m or m.group(2) not in _EXPERT_NAMES:
        return None
    part = _EXPERT_NAMES[m.group(2)]
    return [f"model.layers.{m.group(1)}.mlp.experts.{e}.{part}.weight" for e in range(experts)]


def tensor_to_numpy(t) -> np.ndarray:
    """Dequantizes one GGUF tensor to float32 in row-major [rows, cols] order."""
    shape = tuple(int(x) for x in reversed(t.shape))
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        arr = np.array(t.data, dtype=np.float32)  # copies: the reader's memmap is read-only
    else:
        arr = dequantize(t.data, t.tensor_type)
    return arr.reshape(shape)


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved rotary pairs -> HF rotate_half halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_config(reader: GGUFReader) -> ModelConfig:
    arch_name = field_value(reader, "general.architecture")
    if arch_name not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch_name!r}; shoal supports {sorted(_ARCHS)}")

    def key(k, default=None):
        return field_value(reader, f"{arch_name}.{k}", default)

    names = {t.name for t in reader.tensors}
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", len(tokens) if tokens is not None else 0))
    factors = None
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        factors = tuple(float(x) for x in tensor_to_numpy(rope_freqs))
    scaling_type = key("rope.scaling.type", "none")
    scaling = RopeScaling()
    if scaling_type not in ("none", None) and factors is None:
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
    sliding = key("attention.sliding_window")
    experts = int(key("expert_count", 0) or 0)
    arch = "mixtral" if arch_name == "llama" and experts else _ARCHS[arch_name]
    layers = int(key("block_count"))
    moe = {}
    if experts:
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=int(key("expert_used_count")),
            moe_intermediate_size=int(key("expert_feed_forward_length", key("feed_forward_length"))),
            shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0) or 0),
            norm_topk_prob=bool(key("expert_weights_norm", _NORM_TOPK.get(arch, False))),
            dense_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names),
        )
    q_norm = next((t for t in reader.tensors if t.name == "blk.0.attn_q_norm.weight"), None)
    head_dim = int(key("attention.key_length", hidden // heads))
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm=q_norm is not None,
        # olmoe norms the whole q projection, qwen3 each head
        qk_norm_per_head=q_norm is None or int(q_norm.shape[0]) == head_dim,
        sliding_window=int(sliding) if sliding else None,
        rope_freq_factors=factors,
        pooling=gguf_pooling(key("pooling_type")),
        **moe,
    )


def iter_gguf_weights(
    reader: GGUFReader, cfg: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    permuted = field_value(reader, "general.architecture") == "llama"
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        experts = hf_expert_names(t.name, cfg.num_experts)
        if experts is not None:
            arr = tensor_to_numpy(t)
            for e, expert_name in enumerate(experts):
                yield expert_name, torch.from_numpy(np.ascontiguousarray(arr[e])).to(dtype)
            continue
        if name is None:
            if t.name == "rope_freqs.weight":
                continue
            raise KeyError(f"GGUF tensor {t.name!r} is not part of a {cfg.architecture} model")
        arr = tensor_to_numpy(t)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = unpermute_rotary(arr, cfg.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = unpermute_rotary(arr, cfg.num_kv_heads)
        yield name, torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)


# Bytes per block of 32 values: fp16 scale (and fp16 minimum for Q4_1), then the quants.
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}


def _blocks_of(t) -> BlockWeights | None:
    """The tensor's quantized blocks in shoal's layout, for the GGUF types the int4 path runs as
    stored (Q4_0 becomes Q4_1 with minimum -8 * scale, which is exact)."""
    kind = t.tensor_type
    if kind not in _BLOCK_BYTES:
        return None
    rows = int(np.prod([int(n) for n in t.shape[1:]])) if len(t.shape) > 1 else 1  # all experts' rows
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES[kind])

    def part(start: int, end: int | None = None) -> np.ndarray:
        return np.ascontiguousarray(blocks[..., start:end])

    d = torch.from_numpy(part(0, 2).view(np.float16)[..., 0]).float()
    if kind == GGMLQuantizationType.Q8_0:
        return BlockWeights("q8_0", torch.from_numpy(part(2).view(np.int8)).reshape(rows, -1), d)
    if kind == GGMLQuantizationType.Q4_1:
        mn = torch.from_numpy(part(2, 4).view(np.float16)[..., 0]).float()
        return BlockWeights("q4_1", torch.from_numpy(part(4)), d, mn)
    return BlockWeights("q4_1", torch.from_numpy(part(2)), d, -8 * d)


def iter_gguf_blocks(reader: GGUFReader, cfg: ModelConfig) -> Iterator[tuple[str, BlockWeights]]:
    """The weights a GGUF file stores in block formats shoal computes with directly, by HF name."""
    permuted = field_value(reader, "general.architecture") == "llama"
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        experts = hf_expert_names(t.name, cfg.num_experts)
        if experts is not None:
            blocks = _blocks_of(t)
            if blocks is not None:
                per = blocks.shape[0] // len(experts)
                for e, expert_name in enumerate(experts):
                    yield expert_name, blocks.select_rows(torch.arange(e * per, (e + 1) * per))
            continue
        blocks = None if name is None or not name.endswith(".weight") else _blocks_of(t)
        if blocks is None:
            continue
        heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads if "k_proj" in name else 0
        if permuted and heads:
            # The permutation moves whole rows, and a block never spans rows.
            order = torch.from_numpy(unpermute_rotary(np.arange(blocks.shape[0]), heads))
            blocks = blocks.select_rows(order)
        yield name, blocks
