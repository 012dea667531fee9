"""Reads only one rank's slice of each checkpoint tensor from a safetensors file.

safetensors maps the file and copies out just the requested rows or columns, so a rank of an
N-way split reads about 1/N of the weights (see `ModelShard.slice_of` for which slice)."""

from __future__ import annotations

import torch

from shoal.kernels.cpu import QK
from shoal.models.parallel import ModelShard, Span


def read_slice(f, key: str, shard: ModelShard, name: str | None = None) -> torch.Tensor:
    """Tensor `key` of open safetensors file `f`, cut to `shard`'s part of checkpoint tensor `name`."""
    name = name or key
    where = shard.slice_of(name)
    if where is None:
        return f.get_tensor(key)
    dim, span = where
    return shard.pad_vocab(name, _cut(f, key, dim, span))


def read_block_part(f, key: str, part: str, fmt: str, shard: ModelShard, name: str) -> torch.Tensor:
    """One part ("qs", "d" or "mn") of a block-quantized weight, cut to `shard`'s slice. A split of
    the input dimension (dim 1) falls on whole blocks of 32: in blocks for d, mn and q4_1's qs
    ([N, K/32, 16]), in values for q8_0's qs ([N, K])."""
    where = shard.slice_of(name)
    if where is None:
        return f.get_tensor(key)
    dim, span = where
    return shard.pad_vocab(name, _cut(f, key, dim, _block_part_span(name, dim, span, part, fmt)))


def _block_part_span(name: str, dim: int, span: Span, part: str, fmt: str) -> Span:
    """Where a split of the weight's values falls in one part of its blocks: the same rows for a
    split of dim 0; for dim 1, whole blocks, counted in blocks except in q8_0's qs."""
    if dim == 0 or (part == "qs" and fmt == "q8_0"):
        return span
    if span.start % QK or span.size % QK:
        raise ValueError(f"{name}: a split at {span} does not fall on blocks of {QK}")
    return Span(span.start // QK, span.size // QK)


def _cut(f, key: str, dim: int, span: Span) -> torch.Tensor:
    sl = f.get_slice(key)
    index = [slice(None)] * len(sl.get_shape())
    index[dim] = slice(span.start, span.end)
    return sl[tuple(index)]


def take_blocks(shard: ModelShard, name: str, b):
    """`shard`'s slice of block-quantized weight `b` (a BlockWeights) already in memory."""
    from shoal.models.quant import BlockWeights

    where = shard.slice_of(name)
    if where is None:
        return b
    dim, span = where

    def cut(t, part):
        if t is None:
            return None
        s = _block_part_span(name, dim, span, part, b.format)
        return shard.pad_vocab(name, t.narrow(dim, s.start, s.size))

    return BlockWeights(b.format, cut(b.qs, "qs"), cut(b.d, "d"), cut(b.mn, "mn"))
