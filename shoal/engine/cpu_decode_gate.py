"""Which models the fused C layer runs: an allow-list that fails closed.

cpu_layer.c restates `DecoderLayer.forward` for the features listed here, and nothing else. A model
runs through it only when every feature it has is one of these with a value the C layer computes
the same way; anything else, including a feature added to the model after this list was written,
keeps the model's own forward (the torch reference). So a new config field, layer class, norm,
projection type or hook cannot silently produce wrong tokens on the fast path: it turns the fast
path off, and `fused_refusal` says which feature did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.kernels.cpu import (
    BLOCK_FORMAT_IDS,
    F32_ROWS_FORMAT_ID,
    INT8_ROWS_FORMAT_ID,
    KV_TYPE_IDS,
    LORA_DTYPE_IDS,
    QK,
    decode_attention_supports,
)
from shoal.models.llama import PROJECTIONS, DecoderLayer, LlamaForCausalLM, RMSNorm
from shoal.models.lora_layers import LoRAProjection
from shoal.models.quant import BlockQuantLinear, Int8Linear


def _any(_value: Any) -> bool:
    return True


# Every field of ModelConfig (dotted for nested dataclasses) and the values the C layer handles.
# A field that is not here refuses the fused path, whatever its value.
MODEL_FEATURES: dict[str, Callable[[Any], bool]] = {
    "architecture": lambda v: v in ("llama", "mistral", "qwen2", "qwen3"),
    "vocab_size": _any,  # the embedding and the head run in torch
    "hidden_size": lambda v: v > 0,
    "intermediate_size": lambda v: v > 0,
    "num_layers": _any,
    "num_heads": lambda v: v > 0,
    "num_kv_heads": lambda v: v > 0,
    "head_dim": decode_attention_supports,
    "rms_norm_eps": _any,
    # Rope: the cos/sin tables come from the model's own RotaryEmbedding, so any frequencies it
    # computes (theta, llama3 scaling, GGUF freq factors) reach C unchanged; the rotation itself is
    # the rotate_half layout both paths use.
    "rope_theta": _any,
    "rope_scaling.rope_type": lambda v: v in ("default", "llama3"),
    "rope_scaling.factor": _any,
    "rope_scaling.low_freq_factor": _any,
    "rope_scaling.high_freq_factor": _any,
    "rope_scaling.original_max_position_embeddings": _any,
    "rope_freq_factors": _any,
    "max_position_embeddings": _any,
    "tie_word_embeddings": _any,  # the head, outside the layers
    "qkv_bias": _any,  # ProjectionParams.bias
    "qk_norm": lambda v: not v,  # per-head norms of q and k: not in cpu_layer.c
    "sliding_window": lambda v: v is None or v > 0,  # LayerParams.window
    "qk_norm_per_head": _any,  # (qk_norm itself refuses)
    "clip_qkv": lambda v: v is None,
    "num_experts": lambda v: v == 0,  # a mixture of experts runs in torch (models/moe.py)
    "num_experts_per_tok": _any,  # the rest of the MoE fields mean nothing without experts
    "moe_intermediate_size": _any,
    "shared_expert_intermediate_size": _any,
    "norm_topk_prob": _any,
    "dense_layers": _any,
    "expert_rank": _any,
    "expert_ranks": _any,
    "expert_offset": _any,
    "num_local_experts": _any,
    "expert_all_to_all": _any,
    "pooling": _any,  # an embedding pools the final hidden states, after the layers
}
# The children of a DecoderLayer the C layer reads; another child (q_norm, an adapter) refuses.
LAYER_CHILDREN = {"input_layernorm", "post_attention_layernorm", *PROJECTIONS}
# Projection classes by exact type: a subclass may compute something else. A LoRAProjection
# around one of them is taken too: cpu_lora.c adds its adapters (ProjectionParams.lora).
PROJECTION_TYPES = (nn.Linear, BlockQuantLinear, Int8Linear)
Projection = nn.Linear | BlockQuantLinear | Int8Linear


def base_projection(m: nn.Module) -> nn.Module:
    """The projection under a LoRA wrapper (the module itself when it has none)."""
    return m.base if type(m) is LoRAProjection else m


def projection_weights(
    linear: Projection,
) -> tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(format id, weight values, scales, minimums) as cpu_layer.c reads them."""
    if isinstance(linear, nn.Linear):
        return F32_ROWS_FORMAT_ID, linear.weight, None, None
    if isinstance(linear, Int8Linear):
        return INT8_ROWS_FORMAT_ID, linear.weight, linear.scale, None
    return BLOCK_FORMAT_IDS[linear.format], linear.qs, linear.d, linear.mn


@dataclass(frozen=True)
class Refusal:
    """The first feature the fused layer does not handle, and its value."""

    feature: str
    value: Any

    def __str__(self) -> str:
        return f"{self.feature} = {self.value!r}"


def _config_items(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _config_items(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def _config_refusal(cfg: Any) -> Refusal | None:
    for name, value in _config_items(cfg):
        allowed = MODEL_FEATURES.get(name)
        if allowed is None:
            return Refusal(f"unknown model feature {name}", value)
        if not allowed(value):
            return Refusal(name, value)
    if cfg.num_heads % cfg.num_kv_heads:
        return Refusal("num_heads per num_kv_heads", cfg.num_heads / cfg.num_kv_heads)
    return None


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _projection_refusal(where: str, m: nn.Module) -> Refusal | None:
    if type(m) is LoRAProjection:
        if _hooked(m) or "forward" in vars(m):
            return Refusal(f"{where} forward", "hooked or replaced")
        if any(stack.a.dtype not in LORA_DTYPE_IDS or stack.a.device.type != "cpu" for _, stack in m.parts):
            return Refusal(f"{where} adapters", "not float32 or float16 on the CPU")
        where, m = f"{where}.base", m.base
        if _hooked(m) or "forward" in vars(m):
            return Refusal(f"{where} forward", "hooked or replaced")
    if type(m) not in PROJECTION_TYPES:
        return Refusal(f"{where} type", type(m).__name__)
    if isinstance(m, BlockQuantLinear) and m.format not in BLOCK_FORMAT_IDS:
        return Refusal(f"{where} quantization", m.format)
    if isinstance(m, BlockQuantLinear | Int8Linear) and m.in_features % QK:
        return Refusal(f"{where} in_features (quantized blocks of {QK})", m.in_features)
    return None


def _tensor_refusal(where: str, tensors: dict[str, torch.Tensor | None]) -> Refusal | None:
    """The tensors C reads must be float32 (or the format's integers), contiguous, in CPU memory."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cpu":
            return Refusal(f"{where}.{name} device", str(t.device))
        if not t.is_contiguous():
            return Refusal(f"{where}.{name} layout", "not contiguous")
        if t.is_floating_point() and t.dtype != torch.float32:
            return Refusal(f"{where}.{name} dtype", str(t.dtype).removeprefix("torch."))
    return None


def _layer_refusal(i: int, layer: nn.Module) -> Refusal | None:
    where = f"layers[{i}]"
    if type(layer) is not DecoderLayer:
        return Refusal(f"{where} type", type(layer).__name__)
    children = dict(layer.named_children())
    if set(children) != LAYER_CHILDREN:
        return Refusal(f"{where} children", sorted(set(children) ^ LAYER_CHILDREN))
    if layer._parameters or layer._buffers:
        return Refusal(f"{where} own tensors", sorted([*layer._parameters, *layer._buffers]))
    for name, child in [("", layer), *children.items()]:
        if _hooked(child) or "forward" in vars(child):  # hooks, or a forward patched on the instance
            return Refusal(f"{where}{'.' + name if name else ''} forward", "hooked or replaced")
    for name in ("input_layernorm", "post_attention_layernorm"):
        if type(children[name]) is not RMSNorm:  # the norm type
            return Refusal(f"{where}.{name} type", type(children[name]).__name__)
    read = {
        f"{name}.weight": children[name].weight for name in ("input_layernorm", "post_attention_layernorm")
    }
    for name in PROJECTIONS:
        refusal = _projection_refusal(f"{where}.{name}", children[name])
        if refusal is not None:
            return refusal
        base = base_projection(children[name])
        _, values, scales, mins = projection_weights(base)
        parts = {"values": values, "scales": scales, "minimums": mins, "bias": base.bias}
        read.update({f"{name}.{part}": t for part, t in parts.items()})
    return _tensor_refusal(where, read)


def fused_refusal(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Refusal | None:
    """None when the fused C layer computes what this model's layers compute on these caches, else
    the first feature that it does not. (The activation, SiLU-gated, and the order of the layer's
    ops are fixed by DecoderLayer itself, which is matched by exact type.)"""
    if type(model) is not LlamaForCausalLM:
        return Refusal("model type", type(model).__name__)
    refusal = _config_refusal(model.cfg)
    if refusal is not None:
        return refusal
    if model.dtype != torch.float32:
        return Refusal("dtype", str(model.dtype).removeprefix("torch."))
    for i, layer in enumerate(model.layers):
        refusal = _layer_refusal(i, layer)
        if refusal is not None:
            return refusal
    for k, v in kv_caches:
        for t in (k, v):
            if t.dtype not in KV_TYPE_IDS:
                return Refusal("kv dtype", str(t.dtype).removeprefix("torch."))
            if t.device.type != "cpu" or not t.is_contiguous():
                return Refusal("kv cache placement", f"{t.device}, contiguous={t.is_contiguous()}")
    return None
