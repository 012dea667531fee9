"""Paged decode attention for CUDA devices, in Triton.

One program per (row, KV head): the query heads that share a KV head read each of its key/value
blocks once, through the row's block table, up to the row's context length, with an online softmax
in float32. Its launch shape depends only on the batch size, never on context lengths, so a decode
step that calls it can be captured in a CUDA graph and replayed (shoal.engine.cuda_graphs).
Triton ships with CUDA builds of torch; where it is missing, callers keep the SDPA path.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
        stride_qb, stride_qh, stride_tb, stride_ks, stride_kh, stride_ob, stride_oh,
        scale, window,
        BLOCK: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
        D_PAD: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kh = tl.program_id(1)
        ctx = tl.load(lens_ptr + b)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        gmask = g < GROUP
        dmask = d < D
        heads = kh * GROUP + g
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(tl.float32)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        start = 0
        if window > 0:
            start = tl.maximum(ctx - window, 0)
        offs = tl.arange(0, BLOCK)
        for blk in range(start // BLOCK, tl.cdiv(ctx, BLOCK)):
            block_id = tl.load(tables_ptr + b * stride_tb + blk).to(tl.int64)
            pos = blk * BLOCK + offs
            slots = block_id * BLOCK + offs
            kv_off = slots[:, None] * stride_ks + kh * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=dmask[None, :], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_off, mask=dmask[None, :], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK]
            valid = (pos < ctx) & (pos >= start)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=gmask[:, None] & dmask[None, :],
        )

    return paged_decode


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    window: int | None,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (heads and dims contiguous); caches [slots, Hk, D]; tables [B, W] and lens [B]
    int on q's device. Returns [B, Hq, D]; every row needs lens >= 1."""
    b, hq, dim = q.shape
    hk = k_cache.shape[1]
    if q.stride(2) != 1 or q.stride(1) != dim:
        q = q.contiguous()
    if out is None:
        out = torch.empty((b, hq, dim), dtype=q.dtype, device=q.device)
    group = hq // hk
    _kernel()[(b, hk)](
        q, k_cache, v_cache, tables, lens, out,
        q.stride(0), q.stride(1), tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1),
        scale, window or 0,
        BLOCK=block_size, GROUP=group, GROUP_PAD=_pow2(group), D=dim, D_PAD=_pow2(dim),
    )  # fmt: skip
    return out
