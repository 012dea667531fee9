"""Paged decode attention for CUDA devices, in Triton.

One program per (row, KV head): the query heads that share a KV head read its keys and values
once, a tile of positions at a time (each position's block looked up in the row's table, so a tile
spans several blocks and the loop runs few times: at decode sizes each turn costs a memory round
trip, not arithmetic), with an online softmax in float32. Given the step's own keys and values, it
also writes them into the cache and attends to them from registers, which saves the two copy
kernels a layer would otherwise launch before it. Its launch shape depends only on the batch size,
never on context lengths, so a decode step that calls it can be captured in a CUDA graph and
replayed (shoal.engine.cuda_graphs). Triton ships with CUDA builds of torch; where it is missing,
callers keep the SDPA path.
"""

from __future__ import annotations

import functools

import torch

# Elements of the [query heads, tile, head dim] product one program holds: the tile is as many
# positions as fit (at least one block, at most 128).
TILE_ELEMENTS = 16384


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
        q_ptr, k_ptr, v_ptr, k_new_ptr, v_new_ptr, slots_ptr, tables_ptr, lens_ptr, out_ptr,
        stride_qb, stride_qh, stride_nb, stride_nh, stride_tb, stride_ks, stride_kh,
        stride_ob, stride_oh, scale, window,
        BLOCK: tl.constexpr, TILE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        D: tl.constexpr, D_PAD: tl.constexpr, WRITES_NEW: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kh = tl.program_id(1)
        ctx = tl.load(lens_ptr + b).to(tl.int32)
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
        start = 0
        if window > 0:
            start = tl.maximum(ctx - window, 0)
        end = ctx  # positions [start, end) come from the cache
        if WRITES_NEW:
            # The row's newest position (ctx - 1) is this step's token: store its K/V for later
            # steps, and start the softmax from it, rounded to the cache's type as a read would be.
            end = ctx - 1
            slot = tl.load(slots_ptr + b).to(tl.int64)
            new_off = b * stride_nb + kh * stride_nh + d
            cache_off = slot * stride_ks + kh * stride_kh + d
            k_new = tl.load(k_new_ptr + new_off, mask=dmask, other=0.0).to(k_ptr.dtype.element_ty)
            v_new = tl.load(v_new_ptr + new_off, mask=dmask, other=0.0).to(v_ptr.dtype.element_ty)
            tl.store(k_ptr + cache_off, k_new, mask=dmask)
            tl.store(v_ptr + cache_off, v_new, mask=dmask)
            m = tl.sum(q * k_new.to(tl.float32)[None, :], axis=1) * scale
            denom = tl.full([GROUP_PAD], 1.0, tl.float32)
            acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32) + v_new.to(tl.float32)[None, :]
        else:
            m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            denom = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        offs = tl.arange(0, TILE)
        for tile in range(start // TILE, tl.cdiv(end, TILE)):
            pos = tile * TILE + offs
            valid = (pos >= start) & (pos < end)
            block_id = tl.load(tables_ptr + b * stride_tb + pos // BLOCK, mask=valid, other=0).to(tl.int64)
            slots = block_id * BLOCK + pos % BLOCK
            kv_off = slots[:, None] * stride_ks + kh * stride_kh + d[None, :]
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, TILE]
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


def tile_positions(block_size: int, group_pad: int, dim_pad: int) -> int:
    """Positions one turn of a program's loop reads: a power of two, at least a block."""
    fit = TILE_ELEMENTS // (group_pad * dim_pad)
    return max(block_size, min(128, 1 << max(0, fit.bit_length() - 1)))


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
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (heads and dims contiguous); caches [slots, Hk, D]; tables [B, W] and lens [B]
    int on q's device. Returns [B, Hq, D]; every row needs lens >= 1. `new_kv`: (k [B, Hk, D],
    v [B, Hk, D], slots [B]) of the step's own tokens, at position lens - 1 of their rows: written
    into the caches at `slots` here (their heads' elements contiguous, k and v strided alike)."""
    b, hq, dim = q.shape
    hk = k_cache.shape[1]
    if q.stride(2) != 1 or q.stride(1) != dim:
        q = q.contiguous()
    if out is None:
        out = torch.empty((b, hq, dim), dtype=q.dtype, device=q.device)
    group = hq // hk
    group_pad, dim_pad = _pow2(group), _pow2(dim)
    tile = tile_positions(block_size, group_pad, dim_pad)
    if new_kv is None:
        k_new = v_new = slots = q  # not read
        stride_nb = stride_nh = 0
    else:
        k_new, v_new, slots = new_kv
        if k_new.stride(2) != 1 or v_new.stride(2) != 1 or k_new.stride()[:2] != v_new.stride()[:2]:
            k_new, v_new = k_new.contiguous(), v_new.contiguous()
        stride_nb, stride_nh = k_new.stride(0), k_new.stride(1)
    _kernel()[(b, hk)](
        q, k_cache, v_cache, k_new, v_new, slots, tables, lens, out,
        q.stride(0), q.stride(1), stride_nb, stride_nh, tables.stride(0), k_cache.stride(0),
        k_cache.stride(1), out.stride(0), out.stride(1), scale, window or 0,
        BLOCK=block_size, TILE=tile, GROUP=group, GROUP_PAD=group_pad, D=dim, D_PAD=dim_pad,
        WRITES_NEW=new_kv is not None, num_warps=8 if group_pad * tile * dim_pad > 8192 else 4,
    )  # fmt: skip
    return out
