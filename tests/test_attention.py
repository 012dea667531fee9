"""Paged attention against plain dense attention, and the decode length grouping."""

from __future__ import annotations

import dataclasses
import itertools
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.engine.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    DecodeBatch,
    DecodeGroup,
    PrefillSpan,
    TorchPagedAttention,
    TritonPagedAttention,
    decode_mask,
    group_by_length,
    prefill_mask,
)
from shoal.engine.forward_paths import triton_takes
from shoal.kernels.build import cpu_supports_kernels
from shoal.kernels.cpu import cpu_kernels

BS, HK, HQ, D = 4, 2, 6, 8


def split_cost(lengths, groups, cost):
    return sum(cost + (end - start) * lengths[end - 1] for start, end in groups)


def assert_a_contiguous_cover(groups, n):
    assert groups[0][0] == 0 and groups[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=7), st.integers(0, 500))
def test_grouping_is_an_optimal_contiguous_partition(lengths, cost):
    lengths.sort()
    groups = group_by_length(lengths, cost)
    assert_a_contiguous_cover(groups, len(lengths))
    n = len(lengths)
    best = min(
        split_cost(lengths, list(zip((0, *cuts), (*cuts, n))), cost)
        for k in range(n)
        for cuts in itertools.combinations(range(1, n), k)
    )
    assert split_cost(lengths, groups, cost) == best


def quadratic_split_cost(lengths, cost):
    """The cheapest contiguous split, by the plain O(n^2) recurrence."""
    best = [0] + [None] * len(lengths)
    for i in range(1, len(lengths) + 1):
        best[i] = min(best[j] + cost + (i - j) * lengths[i - 1] for j in range(i))
    return best[-1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4000), min_size=1, max_size=300), st.integers(0, 1000))
def test_grouping_a_large_step_is_as_cheap_as_the_quadratic_recurrence(lengths, cost):
    lengths.sort()
    groups = group_by_length(lengths, cost)
    assert_a_contiguous_cover(groups, len(lengths))
    assert split_cost(lengths, groups, cost) == quadratic_split_cost(lengths, cost)


def dense(q, keys, values, window=None):
    """Attention of the last len(q) positions over `keys`, written out by hand."""
    ctx, nq, D = keys.shape[0], q.shape[0], q.shape[-1]
    k = keys.repeat_interleave(HQ // HK, dim=1)
    v = values.repeat_interleave(HQ // HK, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    qpos = torch.arange(ctx - nq, ctx).unsqueeze(1)
    kpos = torch.arange(ctx).unsqueeze(0)
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_the_cpu_kernels_build_where_the_cpu_supports_them():
    # The C kernel tests below skip without them; on an AVX2 machine with a compiler that would
    # hide a broken build, so it fails here instead.
    if os.environ.get("SHOAL_NO_KERNELS"):
        pytest.skip("kernels turned off by SHOAL_NO_KERNELS")
    if cpu_supports_kernels():
        assert cpu_kernels() is not None


def on(obj, device: str):
    """Every tensor in `obj` (a tensor, a list, a dataclass of those) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [on(x, device) for x in obj]
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(
            obj, **{f.name: on(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        )
    return obj


# 72: the C kernel's 64-wide register path plus its 8-wide tail (and a head the Triton kernel pads).
@pytest.mark.parametrize("D", [8, 72])
@pytest.mark.parametrize("backend", ["torch", "cpu_kernel", "triton"])
def test_paged_matches_dense_for_mixed_batches(backend, D):
    if backend == "cpu_kernel" and cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    if backend == "triton" and not triton_takes(torch.device("cuda"), BS):
        pytest.skip("no CUDA device with Triton here")
    dev = "cuda" if backend == "triton" else "cpu"
    rng = random.Random(0)
    torch.manual_seed(0)
    num_blocks = 64
    caches = [
        (torch.randn(num_blocks * BS, HK, D, device=dev), torch.randn(num_blocks * BS, HK, D, device=dev))
    ]
    for window in (None, 5):
        if backend == "torch":
            attn = TorchPagedAttention(caches, BS, D**-0.5, window)
        elif backend == "triton":
            attn = TritonPagedAttention(caches, BS, D**-0.5, window)
        else:
            attn = CpuPagedAttention(cpu_kernels(), caches, BS, D**-0.5, window)
        free = list(range(num_blocks))
        rng.shuffle(free)
        # (context before this step, tokens this step): four decode rows of mixed length (the
        # longest spans several of the C kernel's key chunks), then a fresh prefill and a prefill
        # chunk continuing earlier context.
        seqs = [(3, 1), (9, 1), (10, 1), (70, 1), (0, 7), (6, 5)]
        tables = []
        for before, n in seqs:
            tables.append([free.pop() for _ in range(-(-(before + n) // BS))])
        slot = [[t[p // BS] * BS + p % BS for p in range(b + n)] for t, (b, n) in zip(tables, seqs)]
        q = torch.randn(sum(n for _, n in seqs), HQ, D)
        k, v = torch.randn(q.shape[0], HK, D), torch.randn(q.shape[0], HK, D)
        new_slots = [s for (b, n), sl in zip(seqs, slot) for s in sl[b:]]
        ctx = [b + 1 for b, _ in seqs[:4]]
        groups = []
        for start, end in group_by_length(ctx, group_cost=8):
            length = ctx[end - 1]
            width = -(-length // BS)
            table = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables[start:end]])
            groups.append(
                DecodeGroup(start, end, length, table, decode_mask(ctx[start:end], length, window, "cpu"))
            )
        assert len(groups) > 1
        prefills = [
            PrefillSpan(4, 11, 7, None, prefill_mask(7, 7, window, "cpu")),
            PrefillSpan(11, 16, 11, torch.tensor(tables[5]), prefill_mask(5, 11, window, "cpu")),
        ]
        width = max(len(t) for t in tables[:4])
        batch = DecodeBatch(
            4, torch.tensor([t + [0] * (width - len(t)) for t in tables[:4]]), torch.tensor(ctx)
        )
        md = AttentionMetadata(torch.tensor(new_slots), groups, prefills, batch)
        out = attn.forward(0, q.to(dev), k.to(dev), v.to(dev), on(md, dev)).cpu()
        keys, values = caches[0][0].cpu(), caches[0][1].cpu()  # with this step's K/V written
        row = 0
        for (_, n), sl in zip(seqs, slot):
            idx = torch.tensor(sl)
            ref = dense(q[row : row + n], keys[idx], values[idx], window)
            torch.testing.assert_close(out[row : row + n], ref, atol=1e-5, rtol=1e-5)
            row += n
