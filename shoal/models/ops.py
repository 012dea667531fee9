"""Small tensor operations the model's modules share, on the C kernels where they help."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels import triton_ops
from shoal.kernels.cpu import kernels_for


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T; on CPU a few float32 rows go through the C kernel, which reads the weights at
    memory speed where torch's small-batch matmul does not."""
    kernels = kernels_for(x, weight) if x.dim() == 2 else None
    if kernels is None or kernels.choices.f32_uses_torch(x.shape[0]):
        return F.linear(x, weight)
    return kernels.f32_linear(x, weight)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dim() == 2 and triton_ops.fused_ops_for(gate_up):
        return triton_ops.silu_mul(gate_up)
    kernels = kernels_for(gate_up)
    if kernels is not None:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
