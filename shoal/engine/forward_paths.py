"""The runner's forward paths: the ways one step's flattened batch can run through the model's
layers, each saying which steps it takes.

They are built once per runner, in one place (`build_forward_paths`), and asked in order: the
first that handles a step runs it. Fast paths come first and take only the steps they are built
for (decode-shaped steps, with per-row block tables in `md.token_batch`); the torch reference
comes last and takes every step, so a step no fast path knows always has somewhere to go, and
every fast path is tested against it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from shoal.engine.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    TorchPagedAttention,
    TritonPagedAttention,
)
from shoal.engine.cpu_decode import CpuFusedDecoder
from shoal.engine.cpu_experts import attach_fused_experts
from shoal.engine.cuda_graphs import CudaGraphDecoder
from shoal.kernels.cpu import cpu_kernels, decode_attention_supports
from shoal.kernels.triton_attention import triton_available
from shoal.models.llama import LlamaForCausalLM

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class GraphOptions:
    """CUDA graphs for decode steps of up to `max_rows` rows and contexts of `max_model_len`."""

    max_rows: int
    max_model_len: int

    def usable(self, device: torch.device, block_size: int) -> bool:
        # Off CUDA there is nothing to capture.
        return triton_takes(device, block_size) and self.max_rows > 0


def triton_takes(device: torch.device, block_size: int) -> bool:
    """Whether the Triton paged kernel runs here: on CUDA, over power-of-two blocks."""
    return device.type == "cuda" and block_size & (block_size - 1) == 0 and triton_available()


class ForwardPath(Protocol):
    name: str

    def wants_token_batch(self, rows: int, has_prefills: bool) -> bool:
        """Whether a step of this shape should get per-row block tables (`md.token_batch`), the
        input the fast paths take."""
        ...

    def handles(self, md: AttentionMetadata) -> bool: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        received: torch.Tensor | None,
    ) -> torch.Tensor:
        """Final hidden states [rows, hidden] (before the last norm); a later pipeline stage
        starts from the previous stage's `received` hidden states."""
        ...


class FusedCpuPath:
    """Each decoder layer as one C call (engine.cpu_decode), up to this CPU's measured crossover."""

    name = "cpu_fused"

    def __init__(self, decoder: CpuFusedDecoder):
        self.decoder = decoder

    def wants_token_batch(self, rows: int, has_prefills: bool) -> bool:
        return self.decoder.takes_rows(rows)  # prompt rows too: each is one query over its context

    def handles(self, md: AttentionMetadata) -> bool:
        return self.decoder.handles(md)

    def forward(self, input_ids, positions, md, received):
        return self.decoder.forward(input_ids, positions, md, received)


class CudaGraphPath:
    """Decode-only steps replayed from captured CUDA graphs (engine.cuda_graphs)."""

    name = "cuda_graphs"

    def __init__(self, decoder: CudaGraphDecoder):
        self.decoder = decoder

    def wants_token_batch(self, rows: int, has_prefills: bool) -> bool:
        return self.decoder.takes_step(rows, has_prefills)

    def handles(self, md: AttentionMetadata) -> bool:
        return self.decoder.handles(md)

    def forward(self, input_ids, positions, md, received):
        # Graphs are captured only for a model in one process: there is never a previous stage.
        return self.decoder.forward(input_ids, positions, md)


class ReferencePath:
    """The model's own torch forward over a paged attention backend: takes every step."""

    name = "torch"

    def __init__(self, model: LlamaForCausalLM, attention: CpuPagedAttention | TorchPagedAttention):
        self.model = model
        self.attention = attention

    def wants_token_batch(self, rows: int, has_prefills: bool) -> bool:
        return False

    def handles(self, md: AttentionMetadata) -> bool:
        return True

    def forward(self, input_ids, positions, md, received):
        attend = lambda layer, q, k, v: self.attention.forward(layer, q, k, v, md)  # noqa: E731
        return self.model(input_ids, positions, attend, received)


class ForwardPaths:
    """The paths in the order they are asked, the reference last."""

    def __init__(self, paths: list[ForwardPath], attention: CpuPagedAttention | TorchPagedAttention):
        self.paths = paths
        self.attention = attention  # the reference's backend: its needs shape the step's metadata

    def wants_token_batch(self, rows: int, has_prefills: bool) -> bool:
        return any(p.wants_token_batch(rows, has_prefills) for p in self.paths)

    def pick(self, md: AttentionMetadata) -> ForwardPath:
        return next(p for p in self.paths if p.handles(md))

    def named(self, name: str) -> ForwardPath | None:
        return next((p for p in self.paths if p.name == name), None)


def build_forward_paths(
    model: LlamaForCausalLM,
    kv_caches: KVCaches,
    block_size: int,
    device: torch.device,
    graphs: GraphOptions | None,
    num_blocks: int,
) -> ForwardPaths:
    """The paths this model, device and pool can run. `graphs`: usable graph options (the pool
    then has one extra block, after `num_blocks`, for padded rows)."""
    cfg = model.cfg
    dtype = model.dtype
    args = (kv_caches, block_size, cfg.head_dim**-0.5, cfg.sliding_window, dtype)
    paths: list[ForwardPath] = []
    kernels = cpu_kernels() if device.type == "cpu" and dtype == torch.float32 else None
    if kernels is not None:
        attach_fused_experts(kernels, model)
    if kernels is not None and decode_attention_supports(cfg.head_dim):
        attention = CpuPagedAttention(kernels, *args)
        fused = CpuFusedDecoder.build(kernels, model, kv_caches, block_size)
        if fused is not None:
            paths.append(FusedCpuPath(fused))
    elif triton_takes(device, block_size):
        attention = TritonPagedAttention(*args)
    else:
        attention = TorchPagedAttention(*args)
    if graphs is not None:
        max_blocks = -(-graphs.max_model_len // block_size)
        paths.append(
            CudaGraphPath(
                CudaGraphDecoder(
                    model, kv_caches, block_size, graphs.max_rows, max_blocks, num_blocks * block_size
                )
            )
        )
    paths.append(ReferencePath(model, attention))
    return ForwardPaths(paths, attention)
