"""Paged attention: a small backend interface and a portable torch implementation.

The KV pool of each layer is one tensor of shape [num_blocks * block_size, kv_heads, head_dim]
(flattened slots). Every step first scatters the new tokens' K/V into their slots, then attends
over each sequence's blocks gathered through its block table. Gathering whole blocks copies
contiguous runs of block_size * kv_heads * head_dim values, which is several times cheaper than
gathering slot by slot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.kernels.cpu import CpuKernels
from shoal.kernels.triton_attention import paged_decode_attention

# Fixed cost of one more decode group (a gather and an SDPA call per layer), in padded key tokens.
# Measured on CPU: a group costs about as much as ~400 extra padded keys.
GROUP_COST_TOKENS = 400


@dataclass
class PrefillSpan:
    """One sequence computing more than one token this step."""

    start: int  # its first row in the flattened batch
    end: int
    context_len: int  # tokens it attends over, including this step's
    block_table: torch.Tensor | None  # [ceil(context_len / bs)]; None when the context is this step's tokens
    mask: torch.Tensor | None  # [q, context_len] bool; None means plain causal


@dataclass
class DecodeGroup:
    """Single-token rows of similar context length, attended together over one padded table."""

    start: int
    end: int
    length: int  # longest context in the group
    block_table: torch.Tensor  # [rows, ceil(length / bs)]
    mask: torch.Tensor | None  # [rows, 1, 1, length]; None when every row attends to all `length` keys


@dataclass
class DecodeBatch:
    """All single-token rows at once, for a backend that attends them in one kernel call."""

    rows: int  # rows [0, rows) of the flattened batch
    block_tables: torch.Tensor  # [rows, max blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [rows] int64


@dataclass
class AttentionMetadata:
    """Built once per step, shared by every layer. Decode rows come as groups or as one batch,
    whichever the backend asks for (`AttentionBackend.decode_in_groups`)."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    decode_batch: DecodeBatch | None = None
    # Every row of the step (prompt rows too) as one query over its own context, for the fused CPU
    # layer: it runs prompt rows exactly as it runs decode rows, so a request's tokens do not depend
    # on how its prompt was chunked, preempted and recomputed, or resumed elsewhere.
    token_batch: DecodeBatch | None = None


def group_by_length(lengths: list[int], group_cost: int = GROUP_COST_TOKENS) -> list[tuple[int, int]]:
    """Split ascending `lengths` into contiguous groups minimising padded keys plus a per-group cost.

    The cheapest split of the first i rows is min over j < i of best[j] + cost + (i - j) * L[i-1]:
    for each j a line in L[i-1] (slope -j, intercept best[j]), with slopes falling as j grows and
    queries L[i-1] rising, so a hull of those lines answers each row in amortised O(1) (a step of
    256 rows would otherwise spend milliseconds of Python here)."""
    n = len(lengths)
    best = [0] * (n + 1)  # best[i]: cheapest split of the first i rows
    cut = [0] * (n + 1)
    hull: deque[int] = deque([0])  # the j whose lines can still be the lowest, slopes falling

    def value(j: int, x: int) -> int:
        return best[j] - j * x

    for i in range(1, n + 1):
        x = lengths[i - 1]
        while len(hull) > 1 and value(hull[1], x) <= value(hull[0], x):
            hull.popleft()
        j = hull[0]
        best[i], cut[i] = best[j] + group_cost + (i - j) * x, j
        # Line i makes the last line useless where it undercuts it before that one undercuts its
        # predecessor (intersections compared without division: slopes -a > -b > -i).
        while len(hull) > 1:
            a, b = hull[-2], hull[-1]
            if (best[i] - best[a]) * (b - a) <= (best[b] - best[a]) * (i - a):
                hull.pop()
            else:
                break
        hull.append(i)
    groups, i = [], n
    while i > 0:
        groups.append((cut[i], i))
        i = cut[i]
    return groups[::-1]


class AttentionBackend:
    decode_in_groups = True

    def forward(self, layer: int, q, k, v, md: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    """Portable: runs wherever torch does (CPU, CUDA), through SDPA."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        scale: float,
        sliding_window: int | None = None,
        compute_dtype: torch.dtype | None = None,
    ):
        self.kv_caches = kv_caches
        # The model's dtype, which attention computes in whatever the cache stores.
        self.compute_dtype = compute_dtype or kv_caches[0][0].dtype
        self.block_size = block_size
        self.scale = scale
        self.sliding_window = sliding_window

    def _blocks(self, cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
        """[*table.shape[:-1], length, kv_heads, head_dim]: the keys or values of the tabled blocks."""
        blocks = cache.view(-1, self.block_size, *cache.shape[1:])[table]
        return blocks.flatten(-4, -3)[..., :length, :, :].to(self.compute_dtype)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata):
        k_cache, v_cache = self.kv_caches[layer]
        if k_cache.dtype != k.dtype:
            # A 16-bit cache: this step's own keys and values are attended as rounded for it, so a
            # token sees the same K/V whichever step computed them.
            k = k.to(k_cache.dtype)
            v = v.to(v_cache.dtype)
        k_cache.index_copy_(0, md.slot_mapping, k)
        v_cache.index_copy_(0, md.slot_mapping, v)
        k, v = k.to(q.dtype), v.to(q.dtype)
        out = torch.empty_like(q)
        self._decode(layer, q, out, md)
        self._prefill(layer, q, k, v, out, md)
        return out

    def _decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, md: AttentionMetadata) -> None:
        k_cache, v_cache = self.kv_caches[layer]
        for g in md.decode_groups:
            # [B, L, Hk, D] -> [B, Hk, L, D]; queries [B, Hq, 1, D]
            kd = self._blocks(k_cache, g.block_table, g.length).transpose(1, 2)
            vd = self._blocks(v_cache, g.block_table, g.length).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[g.start : g.end].unsqueeze(2), kd, vd, attn_mask=g.mask, scale=self.scale, enable_gqa=True
            )
            out[g.start : g.end] = o.squeeze(2)

    def _prefill(self, layer: int, q, k, v, out: torch.Tensor, md: AttentionMetadata) -> None:
        k_cache, v_cache = self.kv_caches[layer]
        for p in md.prefills:
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if p.block_table is None:
                kp, vp = k[p.start : p.end], v[p.start : p.end]
            else:
                kp = self._blocks(k_cache, p.block_table, p.context_len)
                vp = self._blocks(v_cache, p.block_table, p.context_len)
            o = F.scaled_dot_product_attention(
                qp,
                kp.transpose(0, 1).unsqueeze(0),
                vp.transpose(0, 1).unsqueeze(0),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[p.start : p.end] = o[0].transpose(0, 1)


class OneCallDecodeAttention(TorchPagedAttention):
    """Decode rows attend straight from the paged cache in one kernel call a layer (no gather
    copies, no padding, no groups); prefill stays on SDPA, where the work per call is large."""

    decode_in_groups = False

    def _decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, md: AttentionMetadata) -> None:
        batch = md.decode_batch
        if batch is None or batch.rows == 0:
            return
        k_cache, v_cache = self.kv_caches[layer]
        rows = batch.rows
        args = (  # both kernels take these, in this order
            q[:rows],
            k_cache,
            v_cache,
            batch.block_tables,
            batch.context_lens,
            self.block_size,
            self.sliding_window,
            self.scale,
        )
        self._paged_decode(args, out[:rows])

    def _paged_decode(self, args: tuple, out: torch.Tensor) -> None:
        raise NotImplementedError


class CpuPagedAttention(OneCallDecodeAttention):
    """The decode rows in one C call (online softmax)."""

    def __init__(self, kernels: CpuKernels, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernels = kernels

    def _paged_decode(self, args: tuple, out: torch.Tensor) -> None:
        out.copy_(self.kernels.paged_decode_attention(*args))


class TritonPagedAttention(OneCallDecodeAttention):
    """CUDA: the decode rows of a step that a captured graph does not take (one with a prompt, or
    more rows than the graphs hold) in one call of the Triton kernel the graphs replay. Grouped by
    length, each group cost a gather and an SDPA call a layer, launched eagerly: about a
    millisecond a decode row in a step with a prompt on an H200."""

    def _paged_decode(self, args: tuple, out: torch.Tensor) -> None:
        paged_decode_attention(*args, out=out)


def prefill_mask(q_len: int, context_len: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """Causal mask for queries at the last `q_len` positions of a `context_len` context."""
    if context_len == q_len and sliding_window is None:
        return None
    q_pos = torch.arange(context_len - q_len, context_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def decode_mask(
    context_lens: list[int], length: int, sliding_window: int | None, device
) -> torch.Tensor | None:
    """[rows, 1, 1, length] mask of the keys each single-token row attends to."""
    if sliding_window is None and all(c == length for c in context_lens):
        return None
    ctx = torch.tensor(context_lens).unsqueeze(1)
    key_pos = torch.arange(length).unsqueeze(0)
    mask = key_pos < ctx
    if sliding_window is not None:
        mask &= key_pos > ctx - 1 - sliding_window
    return mask.view(len(context_lens), 1, 1, length).to(device)
