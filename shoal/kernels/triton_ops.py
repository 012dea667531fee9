"""The small per-layer operations of a CUDA forward, fused in Triton.

At decode sizes a layer's matrix products read the weights in a few microseconds each, and the
elementwise work between them (residual add and RMSNorm, rotary embedding, SiLU-and-multiply)
costs more as separate torch kernels than as arithmetic: a small kernel takes microseconds to
run however little it does, even replayed from a CUDA graph. Each operation here is one kernel,
computing in float32 and rounding once to the tensors' type. Where Triton is missing, or with
SHOAL_NO_KERNELS set, callers keep the torch operations (shoal.models.ops).
"""

from __future__ import annotations

import functools
import os

import torch

from shoal.kernels.triton_attention import triton_available

SILU_COLUMNS = 1024  # columns of the output one SiLU-and-multiply program writes


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm(
        res_ptr, delta_ptr, w_ptr, out_ptr, n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(res_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            x += tl.load(delta_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(res_ptr + row * n + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
            # The norm reads the residual as stored, as the torch path's add_ then rms_norm does.
            x = x.to(res_ptr.dtype.element_ty).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rotate(
        x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c, heads,
        D: tl.constexpr, D_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
    ):  # fmt: skip
        # One program per token, all its heads at once; rotate_half layout, the sign folded into
        # the sin table (shoal.models.rope). Every load precedes every store: it runs in place.
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < heads) & (d < D)
        base = x_ptr + t * stride_t + h * stride_h
        x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
        rolled = tl.load(base + (d + D // 2) % D, mask=mask, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + t * stride_c + d, mask=d < D, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * stride_c + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(base + d, (x * cos + rolled * sin).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def silu_mul(in_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(in_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(in_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    return triton, add_rms_norm, rotate, silu_mul


def fused_ops_for(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels take these tensors: all on a CUDA device, Triton there, and not
    turned off (SHOAL_NO_KERNELS)."""
    return (
        all(t.device.type == "cuda" for t in tensors)
        and not os.environ.get("SHOAL_NO_KERNELS")
        and triton_available()
    )


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += delta (in place, when given); returns RMSNorm(residual) * weight."""
    triton, kernel, _, _ = _kernels()
    rows, n = residual.shape
    out = torch.empty_like(residual)
    if delta is not None:
        delta = delta.contiguous()
    kernel[(rows,)](
        residual,
        residual if delta is None else delta,
        weight,
        out,
        n,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=triton.next_power_of_2(n),
    )
    return out


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, H, D] in place (its rows may be strided, its heads' elements not); cos and sin
    [T, 1, D] as RotaryEmbedding.tables gives them."""
    triton, _, kernel, _ = _kernels()
    t, heads, d = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    kernel[(t,)](
        x,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        heads,
        D=d,
        D_PAD=triton.next_power_of_2(d),
        HEADS_PAD=triton.next_power_of_2(heads),
    )
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2n] holding gate then up; returns [T, n]."""
    triton, _, _, kernel = _kernels()
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    kernel[(rows, triton.cdiv(n, SILU_COLUMNS))](gate_up.contiguous(), out, n, BLOCK=SILU_COLUMNS)
    return out
