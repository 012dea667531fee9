"""The fused C decode layer against the model's own forward, on the same paged KV state."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.model_runner import ModelRunner
from shoal.engine.scheduler import ScheduledChunk
from shoal.kernels.cpu import cpu_kernels
from shoal.models.config import ModelConfig
from shoal.models.llama import LlamaForCausalLM
from shoal.models.quant import quantize_model

BS = 4


def random_model(method: str | None, **overrides) -> LlamaForCausalLM:
    shape = dict(
        vocab_size=300, hidden_size=96, intermediate_size=160, num_layers=3, num_heads=6, num_kv_heads=2
    )
    cfg = ModelConfig(architecture="qwen2", **{"head_dim": 32, **shape, **overrides})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, max_positions=256)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.uniform_(0.8, 1.2)
    if method is not None:
        quantize_model(model, method)
    return model.eval()


def chunk(rid: int, tokens: list[int], start: int, blocks: list[int]) -> ScheduledChunk:
    return ScheduledChunk(str(rid), tokens, start, blocks, sample=True)


@pytest.mark.parametrize(
    "overrides",
    [{"head_dim": 64}, {"qkv_bias": True, "sliding_window": 5}],
    ids=["llama-like", "bias+window"],
)
@pytest.mark.parametrize("method", ["int4", "int8", None], ids=["int4", "int8", "fp32"])
@torch.inference_mode()
def test_fused_decode_layers_match_the_model_forward(method, overrides):
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    model = random_model(method, **overrides)
    runner = ModelRunner(model, num_blocks=64, block_size=BS, eos_token_ids=frozenset())
    assert runner.fused_decoder is not None
    g = torch.Generator().manual_seed(1)
    lengths = [3, 9, 30, 70]  # the longest spans several of the attention kernel's key chunks
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]
    free = torch.randperm(64, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-(n + 3) // BS))] for n in lengths]
    attend = lambda md: lambda layer, q, k, v: runner.attention.forward(layer, q, k, v, md)  # noqa: E731

    prefill = [chunk(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))]
    ids, pos, md = runner._prepare(prefill)
    assert not runner.fused_decoder.handles(md)
    model(ids, pos, attend(md))

    for step in range(3):
        decode = [chunk(i, [7 * i + step], n + step, t) for i, (n, t) in enumerate(zip(lengths, tables))]
        ids, pos, md = runner._prepare(decode)
        assert runner.fused_decoder.handles(md)
        expected = model(ids, pos, attend(md))
        caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        for k, v in runner.kv_caches:  # the fused path must write this step's K/V itself
            k[md.slot_mapping] = 0
            v[md.slot_mapping] = 0
        got = runner.fused_decoder.forward(ids, pos, md)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
        for (k, v), (k_ref, v_ref) in zip(runner.kv_caches, caches):
            torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)


def test_qk_norm_models_keep_the_model_forward():
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    model = random_model("int4", qk_norm=True)
    runner = ModelRunner(model, num_blocks=8, block_size=BS, eos_token_ids=frozenset())
    assert runner.fused_decoder is None


@pytest.mark.parametrize("rows", [1, 3, 5, 16])
def test_f32_linear_kernel_matches_torch(rows):
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    torch.manual_seed(rows)
    w, x = torch.randn(37, 100), torch.randn(rows, 100)  # K off the kernel's 16-wide step
    torch.testing.assert_close(cpu_kernels().f32_linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
