"""Decode steps on CPU with block-quantized weights: each decoder layer runs as one C call.

A decode step at small batch is a few microseconds of arithmetic per op; dispatching the dozen ops
of a layer from Python costs as much as the weights take to read. The C layer (shoal/kernels/
cpu_layer.c) runs the same kernels in the same order as the model's own forward, so it is a drop-in
for steps where every row is a single token; prefill steps keep the model's forward.
"""

from __future__ import annotations

import torch

from shoal.engine.attention import AttentionMetadata
from shoal.kernels.cpu import BLOCK_FORMAT_IDS, BlockProjection, CpuKernels, LayerParams
from shoal.models.llama import DecoderLayer, LlamaForCausalLM
from shoal.models.quant import BlockQuantLinear

_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _projection(linear: BlockQuantLinear) -> BlockProjection:
    return BlockProjection(
        BLOCK_FORMAT_IDS[linear.format],
        linear.out_features,
        linear.in_features,
        linear.qs.data_ptr(),
        linear.d.data_ptr(),
        0 if linear.mn is None else linear.mn.data_ptr(),
        0 if linear.bias is None else linear.bias.data_ptr(),
    )


def _fusable(layer: DecoderLayer) -> bool:
    linears = [getattr(layer, name) for name in _PROJECTIONS]
    if not all(isinstance(m, BlockQuantLinear) for m in linears):
        return False
    tensors = [t for m in linears for t in (m.qs, m.d, m.mn, m.bias) if t is not None]
    tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and all(
        t.dtype == torch.float32 for t in tensors if t.is_floating_point()
    )


class CpuFusedDecoder:
    """Runs the decoder layers of decode-only steps through `shoal_decode_layer`."""

    def __init__(self, kernels: CpuKernels, model: LlamaForCausalLM, params: list[LayerParams]):
        self.kernels = kernels
        self.model = model
        self.params = params

    @classmethod
    def build(
        cls,
        kernels: CpuKernels,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sliding_window: int | None,
    ) -> CpuFusedDecoder | None:
        """The fused decoder, or None when some layer is not one it runs (float weights, qk-norm)."""
        cfg = model.cfg
        if cfg.qk_norm or not all(_fusable(layer) for layer in model.layers):
            return None
        params = []
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            params.append(
                LayerParams(
                    cfg.hidden_size,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    cfg.head_dim,
                    cfg.intermediate_size,
                    block_size,
                    sliding_window or 0,
                    cfg.rms_norm_eps,
                    cfg.head_dim**-0.5,
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    k_cache.data_ptr(),
                    v_cache.data_ptr(),
                    *(_projection(getattr(layer, name)) for name in _PROJECTIONS),
                )
            )
        return cls(kernels, model, params)

    @staticmethod
    def handles(md: AttentionMetadata) -> bool:
        return not md.prefills and md.decode_batch is not None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (before the last norm), as the model's forward returns."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = (
            t.reshape(t.shape[0], -1).contiguous() for t in self.model.rope.tables(positions, x.dtype)
        )
        batch = md.decode_batch
        delta = None
        for params in self.params:
            delta = self.kernels.decode_layer(
                params, x, delta, cos, sin, md.slot_mapping, batch.block_tables, batch.context_lens
            )
        return x.add_(delta)
