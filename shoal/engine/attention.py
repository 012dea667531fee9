"""Paged attention: a small backend interface and a portable torch implementation.

The KV pool of each layer is one tensor of shape [num_blocks * block_size, kv_heads, head_dim]
(flattened slots). Every step first scatters the new tokens' K/V into their slots, then attends
over each sequence's slots gathered through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence computing more than one token this step."""

    start: int  # its first row in the flattened batch
    end: int
    context_len: int  # tokens it attends over, including this step's
    slots: torch.Tensor | None  # [context_len] KV slots; None when the context is exactly this step's tokens
    mask: torch.Tensor | None  # [q, context_len] bool; None means plain causal


@dataclass
class AttentionMetadata:
    """Built once per step, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decode: int  # rows [0, num_decode) are single-token sequences
    decode_slots: torch.Tensor | None  # [B, L] padded slot table of the decode rows
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is attended
    prefills: list[PrefillSpan]


class AttentionBackend:
    def forward(self, layer: int, q, k, v, md: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        self.kv_caches = kv_caches
        self.scale = scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata):
        k_cache, v_cache = self.kv_caches[layer]
        k_cache.index_copy_(0, md.slot_mapping, k)
        v_cache.index_copy_(0, md.slot_mapping, v)
        out = torch.empty_like(q)
        nd = md.num_decode
        if nd:
            # [B, L, Hk, D] -> [B, Hk, L, D]; queries [B, Hq, 1, D]
            kd = k_cache[md.decode_slots].transpose(1, 2)
            vd = v_cache[md.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), kd, vd, attn_mask=md.decode_mask, scale=self.scale, enable_gqa=True
            )
            out[:nd] = o.squeeze(2)
        for p in md.prefills:
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if p.slots is None:
                kp, vp = k[p.start : p.end], v[p.start : p.end]
            else:
                kp, vp = k_cache[p.slots], v_cache[p.slots]
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
        return out


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
