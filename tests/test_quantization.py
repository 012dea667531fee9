"""Quantized weights: GGUF blocks taken as stored, the C kernels against float64, and the quantized
bundled model against HF transformers' fp32 run of the same file."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shoal.kernels.build import AMX_FLAGS, compiler_accepts, cpu_flags, cpu_supports_kernels
from shoal.kernels.cpu import cpu_kernels
from shoal.llm import LLM
from shoal.models.gguf_loader import iter_gguf_blocks, load_gguf_config
from shoal.models.gguf_meta import open_gguf
from shoal.models.loader import bundled_model_path, load_model
from shoal.models.quant import (
    BlockQuantLinear,
    Int8Linear,
    quantize_q4_1,
    quantize_q8_0,
    repack_x8,
    unpack_x8,
)
from tests.conftest import REF_TOKENS
from tests.helpers import closeness_to_reference, describe_closeness


def test_gguf_blocks_are_the_files_own_values(bundled):
    """Dequantizing the kept blocks gives exactly what gguf-py's dequantizer gave the fp32 model,
    q/k row permutation included."""
    reader = open_gguf(bundled_model_path())
    blocks = dict(iter_gguf_blocks(reader, load_gguf_config(reader)))
    assert {b.format for b in blocks.values()} == {"q4_1", "q8_0"}
    cfg, model = bundled.config, bundled.model
    for i in (0, cfg.num_layers - 1):
        layer = model.layers[i]
        q = blocks[f"model.layers.{i}.self_attn.q_proj.weight"].dequantize()
        k = blocks[f"model.layers.{i}.self_attn.k_proj.weight"].dequantize()
        down = blocks[f"model.layers.{i}.mlp.down_proj.weight"].dequantize()
        torch.testing.assert_close(q, layer.qkv_proj.weight[: cfg.q_size], rtol=0, atol=0)
        torch.testing.assert_close(
            k, layer.qkv_proj.weight[cfg.q_size : cfg.q_size + cfg.kv_size], rtol=0, atol=0
        )
        torch.testing.assert_close(down, layer.down_proj.weight, rtol=0, atol=0)
    embed = blocks["model.embed_tokens.weight"]
    assert embed.format == "q8_0"
    torch.testing.assert_close(embed.dequantize(), model.embed_tokens.weight, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 37])
@pytest.mark.parametrize("quantize", [quantize_q4_1, quantize_q8_0], ids=["q4_1", "q8_0"])
def test_block_linear_matches_a_float64_reference(rows, quantize):
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    torch.manual_seed(rows)
    w = torch.randn(200, 320) * 0.05
    blocks = quantize(w)
    deq = blocks.dequantize()
    # The weight error is bounded by half a quantization step per block.
    assert ((deq - w).abs().view(200, 10, 32) <= blocks.d[..., None] / 2 + 1e-6).all()
    x = torch.randn(rows, 320)
    y = BlockQuantLinear(blocks)(x)
    ref = x.double() @ deq.double().t()
    # What remains is the int8 rounding of the activations: about 1/254 of each block's range.
    assert (y.double() - ref).abs().max() <= 0.01 * ref.abs().max()
    assert y.shape == (rows, 200)


@pytest.mark.parametrize("quantize", [quantize_q4_1, quantize_q8_0], ids=["q4_1", "q8_0"])
def test_blocks_repacked_eight_rows_at_a_time_compute_the_same_product(quantize):
    """The repacked layout holds the same blocks (it unpacks to them exactly) and its kernel gives
    the row-major kernel's product up to float summation order; a layer whose rows are not a
    multiple of 8 keeps the row-major layout."""
    k = cpu_kernels()
    if k is None:
        pytest.skip("no CPU kernels here")
    torch.manual_seed(3)
    blocks = quantize(torch.randn(64, 320) * 0.05)
    packed = repack_x8(blocks)
    back = unpack_x8(packed)
    assert back.format == blocks.format and torch.equal(back.qs, blocks.qs) and torch.equal(back.d, blocks.d)
    assert (back.mn is None) == (blocks.mn is None) and (back.mn is None or torch.equal(back.mn, blocks.mn))
    for rows in (1, 3, 4, 9, 40):
        x = torch.randn(rows, 320)
        ref = k.block_linear(blocks.format, x, blocks.qs, blocks.d, blocks.mn)
        got = k.block_linear(packed.format, x, packed.qs, packed.d, packed.mn)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        # A row's result does not depend on the rows computed beside it.
        assert torch.equal(k.block_linear(packed.format, x[-1:], packed.qs, packed.d, packed.mn), got[-1:])
    layer = BlockQuantLinear(blocks)
    assert layer.format == packed.format and torch.equal(layer.weights.qs, blocks.qs)
    assert BlockQuantLinear(quantize(torch.randn(60, 320))).format == blocks.format


@pytest.mark.parametrize("quantize", [quantize_q4_1, quantize_q8_0], ids=["q4_1", "q8_0"])
def test_a_long_prefills_rows_multiply_in_passes_that_change_no_bit(quantize):
    """The kernel multiplies a long prefill's rows a few hundred at a time (so that they stay in
    cache): 1,100 rows give, bit for bit, what the same rows give 100 or 1 at a time, in both
    layouts."""
    k = cpu_kernels()
    if k is None:
        pytest.skip("no CPU kernels here")
    torch.manual_seed(5)
    blocks = quantize(torch.randn(64, 320) * 0.05)
    x = torch.randn(1100, 320)
    for b in (blocks, repack_x8(blocks)):
        whole = k.block_linear(b.format, x, b.qs, b.d, b.mn)
        assert torch.equal(
            whole, torch.cat([k.block_linear(b.format, c, b.qs, b.d, b.mn) for c in x.split(100)])
        )
        for i in (0, 511, 512, 1023, 1024, 1099):  # either side of where a pass ends
            assert torch.equal(whole[i : i + 1], k.block_linear(b.format, x[i : i + 1], b.qs, b.d, b.mn))


@pytest.mark.parametrize("rows", [1, 37])
def test_int8_linear_matches_a_float64_reference(rows):
    torch.manual_seed(rows)
    w, b = torch.randn(96, 160), torch.randn(96)
    lin = Int8Linear(w, b)
    x = torch.randn(rows, 160)
    ref = x.double() @ w.double().t() + b.double()
    y = lin(x)
    assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    # Per-token activation scales: a row's result does not depend on the other rows in the batch.
    torch.testing.assert_close(lin(x[:1]), y[:1], rtol=0, atol=0)


_ISA_SCRIPT = """
import sys, torch
from shoal.kernels.build import compile_flags, load_cpu_library
from shoal.kernels.cpu import cpu_kernels
from shoal.models.quant import Int8Linear, quantize_q4_1, quantize_q8_0, repack_x8
torch.manual_seed(0)
k = cpu_kernels()
out = []
# 96 rows: 12 tiles of 8, in pairs where AVX-512 and AMX take two at once; 104: an odd tile left over.
# Batches: 7 (below AMX's threshold), 13 (Q8_0: one zero-padded AMX group), 21 (16 rows on AMX, 5 on
# AVX-512), 40 (Q8_0: 40 on AMX, the last 8 padded; Q4_1: 32 on AMX, 8 on AVX-512).
for n in (96, 104):
    w = torch.randn(n, 320) * 0.05
    q4, q8, i8 = quantize_q4_1(w), quantize_q8_0(w), Int8Linear(w)
    r4, r8 = repack_x8(q4), repack_x8(q8)
    for m in (7, 13, 21, 40):
        x = torch.randn(m, 320)
        out += [
            k.block_linear("q4_1", x, q4.qs, q4.d, q4.mn), k.block_linear("q8_0", x, q8.qs, q8.d, None),
            k.block_linear("q4_1x8", x, r4.qs, r4.d, r4.mn), k.block_linear("q8_0x8", x, r8.qs, r8.d, None),
            k.int8_linear(x, i8.weight, i8.scale),
        ]
amx = "-mamx-int8" in compile_flags() and bool(load_cpu_library().shoal_amx_enable())
torch.save({"amx": amx, "out": out}, sys.argv[1])
"""


def test_avx2_vnni_and_amx_kernel_builds_agree_bit_for_bit(tmp_path):
    """The byte dot products are exact in every instruction set, and each output's float operations
    run in the same order, so every build gives the same bits; this runs the AVX2 and AVX-512 builds'
    code paths even on a CPU where a newer one would be chosen."""
    if cpu_kernels() is None or not cpu_supports_kernels():
        pytest.skip("no CPU kernels here")
    runs = {}
    builds = (("avx2", "SHOAL_KERNELS_AVX2_ONLY"), ("vnni", "SHOAL_KERNELS_NO_AMX"), ("best", ""))
    for name, env_var in builds:
        out = tmp_path / f"{name}.pt"
        env = {**os.environ, "SHOAL_KERNELS_AVX2_ONLY": "", "SHOAL_KERNELS_NO_AMX": ""}
        if env_var:
            env[env_var] = "1"
        subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(out)], env=env, check=True)
        runs[name] = torch.load(out)
    assert not runs["avx2"]["amx"] and not runs["vnni"]["amx"]
    # Where the CPU has AMX the default build must use it, or this test would not cover it.
    assert runs["best"]["amx"] == ({"amx_tile", "amx_int8"} <= cpu_flags() and compiler_accepts(AMX_FLAGS))
    for other in ("vnni", "best"):
        for a, b in zip(runs["avx2"]["out"], runs[other]["out"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 40, 300])
def test_every_int8_path_is_bit_identical_to_the_torch_formula(rows):
    """The C kernel (any batch) and torch._int_mm between C rounding and rescaling (more than 16
    rows) give the bits of the plain torch formula, and so does the layer, whichever path this CPU's
    measured crossover picks: a request's output does not depend on how many others share its step."""
    k = cpu_kernels()
    if k is None:
        pytest.skip("no CPU kernels here")
    torch.manual_seed(rows)
    lin = Int8Linear(torch.randn(200, 320))
    x = torch.randn(rows, 320) * torch.logspace(-3, 2, rows).unsqueeze(1)
    xs = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    expected = torch._int_mm((x / xs).round().to(torch.int8), lin.weight_t) * xs * lin.scale
    assert torch.equal(k.int8_linear(x, lin.weight, lin.scale), expected)
    if rows > 16:
        xq, xs_c = k.quantize_rows(x)
        assert torch.equal(k.int8_rescale(torch._int_mm(xq, lin.weight_t), xs_c, lin.scale), expected)
    assert torch.equal(lin(x), expected)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_model_stays_close_to_hf_fp32(method, reference):
    c = closeness_to_reference(LLM(loaded=load_model(quantization=method)), reference, REF_TOKENS)
    print("\n" + describe_closeness(method, c, REF_TOKENS))
    # A greedy continuation leaves HF's for good at its first near-tie, so the matched prefix is the
    # noisiest of these; the thresholds leave room for that (measured figures in the closing notes).
    # int8's per-token activation rounding leaves many near-ties: its agreement moved between 0.885
    # and 0.938 with nothing but float summation order changed (measured), so its bar is lower.
    assert c["agreement"] >= {"int4": 0.95, "int8": 0.85}[method]
    assert c["mean_error"] < 0.2
    assert c["mean_prefix"] >= {"int4": 10, "int8": 3}[method]  # measured 16.2 and 4.6


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_16_bit_kv_cache_holds_twice_the_tokens_and_stays_close_to_hf(kv_dtype, bundled, reference):
    budget = 64 << 20
    full = LLM(loaded=bundled, kv_cache_memory=budget)
    half = LLM(loaded=bundled, kv_cache_memory=budget, kv_cache_dtype=kv_dtype)
    assert half.engine.core.kv.pool.num_blocks == 2 * full.engine.core.kv.pool.num_blocks
    assert half.engine.core.executor.runner.kv_caches[0][0].dtype == getattr(torch, kv_dtype)
    c = closeness_to_reference(half, reference, REF_TOKENS)
    print("\n" + describe_closeness(f"fp32 weights, {kv_dtype} KV cache", c, REF_TOKENS))
    assert c["agreement"] >= 0.95
    assert c["mean_error"] < 0.1
