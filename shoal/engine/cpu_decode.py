"""Steps on CPU with each decoder layer as one C call.

A decode step at small batch is a few microseconds of arithmetic per op; dispatching the dozen ops
of a layer from Python costs as much as the weights take to read. The C layer (shoal/kernels/
cpu_layer.c) does what `DecoderLayer.forward` does, in the same order, and matches it to float
rounding (tests/test_cpu_decode.py). It takes prompt rows too, each as one query over its own
context, so a token's computation is the same whichever step, chunk or replica computes it; steps
larger than the measured crossover (float32 and int8 layers only) keep the model's forward. A
change to the layer's maths must be made in both; which models it takes at all is the allow-list
in cpu_decode_gate.py."""

from __future__ import annotations

import logging

import torch

from shoal.engine.attention import AttentionMetadata
from shoal.engine.cpu_decode_gate import Projection, base_projection, fused_refusal, projection_weights
from shoal.engine.parallel.comm import CommError
from shoal.kernels.abi import LayerParams, ProjectionParams
from shoal.kernels.cpu import F32_ROWS_FORMAT_ID, INT8_ROWS_FORMAT_ID, KV_TYPE_IDS, CpuKernels
from shoal.models.llama import PROJECTIONS, LlamaForCausalLM
from shoal.models.lora_layers import LoRABatch, LoRAProjection

log = logging.getLogger(__name__)


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def projection_params(kernels: CpuKernels, module: Projection | LoRAProjection) -> ProjectionParams:
    """A projection (and its adapters) as cpu_layer.c reads it; its tensors must outlive the result."""
    linear = base_projection(module)
    fmt, values, scales, mins = projection_weights(linear)
    params = ProjectionParams(
        format=fmt,
        n=linear.out_features,
        k=linear.in_features,
        qs=values.data_ptr(),
        d=_pointer(scales),
        mn=_pointer(mins),
        bias=_pointer(linear.bias),
    )
    if isinstance(module, LoRAProjection):
        params.lora_parts = len(module.parts)
        for i, (offset, stack) in enumerate(module.parts):
            params.lora[i] = kernels.lora_params(stack.a, stack.b, stack.ranks, offset)
    return params


class CpuFusedDecoder:
    """Runs the decoder layers of decode-only steps through `shoal_decode_layer`."""

    def __init__(
        self,
        kernels: CpuKernels,
        model: LlamaForCausalLM,
        params: list[LayerParams],
        lora: LoRABatch | None = None,
    ):
        self.kernels = kernels
        self.model = model
        self.params = params
        self.lora = lora  # the step's adapter rows, when the model has adapter slots
        self.scratch = torch.empty(0, dtype=torch.uint8)
        # int8 and float32 layers: from some batch size (measured on this CPU) torch's matmuls are
        # the faster path, and the model's own forward takes those steps.
        formats = {proj.format for p in params for proj in (p.qkv, p.o, p.gate_up, p.down)}
        limits = []
        if INT8_ROWS_FORMAT_ID in formats:
            limits.append(kernels.choices.int8_torch_from_rows)
        if F32_ROWS_FORMAT_ID in formats:
            limits.append(kernels.choices.f32_torch_from_rows)
        limits = [n - 1 for n in limits if n is not None]
        self.max_rows = min(limits) if limits else None

    @classmethod
    def build(
        cls,
        kernels: CpuKernels,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
    ) -> CpuFusedDecoder | None:
        """The fused decoder, or None when the model has a feature outside the allow-list or its
        tensor-parallel collectives are not ones C can call (the reason is logged, once per build)."""
        refusal = fused_refusal(model, kv_caches)
        if refusal is not None:
            log.info("fused CPU decode off, the model's forward runs instead: %s", refusal)
            return None
        cfg = model.cfg
        reduce_fn = comm = 0
        if model.shard.tp_size > 1:
            native = model.comm.native()
            if native is None:
                log.info("fused CPU decode off: the tensor-parallel all-reduce is not shared memory")
                return None
            reduce_fn, comm = native
        params = []
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            projections = {
                name.removesuffix("_proj"): projection_params(kernels, getattr(layer, name))
                for name in PROJECTIONS
            }
            params.append(
                LayerParams(
                    hidden=cfg.hidden_size,
                    heads=cfg.num_heads,
                    kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim,
                    intermediate=cfg.intermediate_size,
                    block_size=block_size,
                    window=cfg.sliding_window or 0,
                    kv_type=KV_TYPE_IDS[k_cache.dtype],
                    eps=cfg.rms_norm_eps,
                    scale=cfg.head_dim**-0.5,
                    input_norm=layer.input_layernorm.weight.data_ptr(),
                    post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                    k_cache=k_cache.data_ptr(),
                    v_cache=v_cache.data_ptr(),
                    allreduce=reduce_fn,
                    comm=comm,
                    **projections,  # qkv, o, gate_up, down
                )
            )
        wrapped = [m for m in model.modules() if isinstance(m, LoRAProjection)]
        return cls(kernels, model, params, wrapped[0].batch if wrapped else None)

    def _scratch(self, rows: int) -> torch.Tensor:
        """The layers' shared work area, grown to the largest step so far and then reused: a step
        allocates nothing, and the pages it touches stay mapped from one step to the next."""
        need = self.kernels.decode_layer_scratch(self.params[0], rows) + 64
        if self.scratch.numel() < need:
            self.scratch = torch.empty(max(need, 2 * self.scratch.numel()), dtype=torch.uint8)
        offset = -self.scratch.data_ptr() % 64
        return self.scratch[offset:]

    def takes_rows(self, rows: int) -> bool:
        """Whether a step of this many rows is faster here than through the model's forward."""
        return self.max_rows is None or rows <= self.max_rows

    def handles(self, md: AttentionMetadata) -> bool:
        """Whether this step is one the C layer runs: every row as one query over its own context
        (the token batch the runner builds for steps within `takes_rows`). What a request asks of
        its tokens (sampling, grammar, logprobs, penalties) acts on the hidden states afterwards,
        so no request feature reaches the layer."""
        return md.token_batch is not None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (before the last norm), as the model's forward returns;
        a later pipeline stage starts from the previous one's `hidden`."""
        x = self.model.embed_tokens(input_ids) if hidden is None else hidden
        cos, sin = (
            t.reshape(t.shape[0], -1).contiguous() for t in self.model.rope.tables(positions, x.dtype)
        )
        batch = md.token_batch
        scratch = self._scratch(batch.rows)
        delta = None
        lora_rows = None if self.lora is None else self.lora.row_slots
        for params in self.params:
            delta = self.kernels.decode_layer(
                params, x, delta, cos, sin, md.slot_mapping, batch.block_tables, batch.context_lens, scratch,
                lora_rows,
            )  # fmt: skip
        if self.model.comm is not None and self.model.comm.failed:
            raise CommError("a tensor-parallel peer did not join an all-reduce in time")
        return x.add_(delta)
