"""A request's K/V packed to move between engines: computed by a prefill worker, loaded into a
decode worker's own blocks (prefill/decode disaggregation) by the KV connector.

The K/V moves as one tensor per request, not block by block, with the hashes of its full blocks:
the receiver checks them against its own hash of the prompt (same model, tokenizer and salt, or
the K/V means something else there) and then offers those blocks to its prefix cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedKV:
    num_tokens: int  # the K/V of the prompt's first num_tokens tokens
    block_hashes: list[int]  # of the full blocks among them, in the sender's hash chain
    data: torch.Tensor  # [layers, 2 (K, V), num_tokens, kv_heads, head_dim], the cache's dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def token_slots(block_ids: list[int], num_tokens: int, block_size: int, device) -> torch.Tensor:
    """The pool slot of each of a request's first num_tokens tokens."""
    pos = torch.arange(num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
    return (blocks * block_size + pos % block_size).to(device)


def pack(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in kv_caches]).cpu()


def unpack(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor, data: torch.Tensor):
    data = data.to(kv_caches[0][0].device)
    for layer, (k, v) in enumerate(kv_caches):
        k[slots] = data[layer, 0]
        v[slots] = data[layer, 1]


def checked(
    packed: PackedKV, num_tokens: int, hashes: list[int], shape: tuple, dtype, block_size: int
) -> PackedKV:
    """The K/V to load for a request of num_tokens tokens. `hashes`: the request's own hash chain
    over the packed tokens' full blocks; `shape`: this engine's (layers, 2, kv_heads, head_dim).
    At least the last token is left to compute, for logits to sample from. ValueError says what
    does not fit."""
    data = packed.data
    if not isinstance(data, torch.Tensor) or data.dim() != 5 or (*data.shape[:2], *data.shape[3:]) != shape:
        got = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
        want = f"[{shape[0]}, 2, tokens, {shape[2]}, {shape[3]}]"
        raise ValueError(f"the transferred K/V has shape {got}; this model's is {want}")
    if data.dtype != dtype:
        raise ValueError(f"the transferred K/V is {data.dtype}; this engine's KV cache is {dtype}")
    if not 0 < packed.num_tokens == data.shape[2] or packed.num_tokens > num_tokens:
        raise ValueError("the transferred K/V's token count does not match its data or the request")
    if list(packed.block_hashes) != hashes:
        raise ValueError(
            "the transferred K/V's block hashes do not match this prompt's (another model, prompt, "
            "tokenizer or KV salt?)"
        )
    n = min(packed.num_tokens, num_tokens - 1)
    return PackedKV(n, hashes[: n // block_size], data[:, :, :n])
