"""The engine on a CUDA device, against HF transformers on the same device (skipped without one).

The portable torch paths (paged SDPA attention, torch matmuls, dequantizing quantized layers) are
what a GPU runs; these check them end to end there, token for token in fp32.
"""

from __future__ import annotations

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.models.loader import load_model
from tests.helpers import assert_pool_whole, hf_greedy
from tests.test_hf_parity import ARCHS, LOGPROB_ATOL, make_random_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _prompts(n_lens=(5, 17, 40, 70)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in n_lens]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_random_checkpoint_matches_hf_on_cuda(arch, tmp_path):
    hf = make_random_checkpoint(arch, tmp_path).to("cuda")
    loaded = load_model(str(tmp_path), device="cuda", quantization="none")
    assert next(loaded.model.parameters()).device.type == "cuda"
    llm = LLM(loaded=loaded, device="cuda", num_blocks=64, max_num_batched_tokens=64)
    # A 64-token budget chunks the prompts, so steps with a prompt chunk also hold decode rows:
    # those rows attend through the Triton kernel outside a graph.
    assert type(llm.engine.core.executor.runner.attention).__name__ == "TritonPagedAttention"
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5))
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt, 12)
        assert out.outputs[0].token_ids == ref_tokens
        for step, lp in enumerate(out.outputs[0].logprobs):
            for token_id, value in lp.top:
                assert abs(value - float(ref_logprobs[step, token_id])) < LOGPROB_ATOL
    assert_pool_whole(llm.engine)


def test_seeded_sampling_draws_the_same_tokens_on_cuda_and_cpu(tmp_path):
    """The sampler's noise is drawn per (seed, position) on the host, so a seed means the same
    draw on either device wherever the logits agree."""
    make_random_checkpoint("llama", tmp_path)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, seed=7, n=2)
    runs = []
    for device in ("cpu", "cuda"):
        llm = LLM(
            loaded=load_model(str(tmp_path), device=device, quantization="none"), device=device, num_blocks=64
        )
        runs.append([[o.token_ids for o in r.outputs] for r in llm.generate(_prompts((9, 33)), params)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_layers_run_on_cuda(method, tmp_path):
    make_random_checkpoint("llama", tmp_path)
    cpu = LLM(loaded=load_model(str(tmp_path), quantization=method), num_blocks=64)
    gpu = LLM(
        loaded=load_model(str(tmp_path), device="cuda", quantization=method), device="cuda", num_blocks=64
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    for a, b in zip(cpu.generate(_prompts(), params), gpu.generate(_prompts(), params)):
        # Same weights, different kernels (C on the host, dequantized matmuls on the GPU): close,
        # not bit-equal, so compare the first token's log-probability.
        assert abs(a.outputs[0].logprobs[0].logprob - b.outputs[0].logprobs[0].logprob) < 0.05
    assert_pool_whole(gpu.engine)


@pytest.mark.parametrize("window, kv_dtype", [(None, "auto"), (8, "auto"), (None, "float16")])
def test_cuda_graph_decode_matches_eager(window, kv_dtype, tmp_path):
    """Decode steps replayed from CUDA graphs (padded batch sizes, the Triton kernel writing the
    step's K/V itself) give the tokens of eager steps (the K/V copied into the cache first, the
    kernel launched per layer), sliding window and 16-bit KV included; the eager path is held to
    dense attention in tests/test_attention.py and to HF above."""
    make_random_checkpoint("mistral", tmp_path, sliding_window=window)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    prompts = _prompts((3, 5, 17, 40, 70))
    runs = []
    for eager in (True, False):
        loaded = load_model(str(tmp_path), device="cuda", quantization="none")
        llm = LLM(
            loaded=loaded,
            device="cuda",
            num_blocks=128,
            enforce_eager=eager,
            max_num_seqs=8,
            kv_cache_dtype=kv_dtype,
        )
        runs.append(llm.generate(prompts, params))
        graphs = llm.engine.core.executor.runner.graph_decoder
        assert (graphs is None) == eager
        assert_pool_whole(llm.engine)
    assert graphs.replays > 0
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x.logprob - y.logprob) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops_match_torch_on_cuda(dtype):
    """Residual add with RMSNorm, rotary embedding (in place, over a strided view of the q/k/v
    buffer, head sizes that are and are not powers of two) and SiLU-and-multiply, each one Triton
    kernel, against the torch operations they replace."""
    import torch.nn.functional as F

    from shoal.kernels import triton_ops
    from shoal.models.config import RopeScaling
    from shoal.models.rope import RotaryEmbedding

    close = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)

    for n in (64, 576, 2048, 100):
        res, delta, w = randn(7, n), randn(7, n), randn(n)
        expect_res = res + delta
        expect = F.rms_norm(expect_res.float(), (n,), w.float(), 1e-5)
        out = triton_ops.add_rms_norm(res, delta, w, 1e-5)
        assert torch.equal(res, expect_res)  # the add rounds once, as torch's does
        torch.testing.assert_close(out.float(), expect, **close)
    for d, hq, hk in ((64, 9, 3), (128, 32, 8), (80, 4, 2)):
        rope = RotaryEmbedding(d, 256, 10000.0, RopeScaling()).to("cuda")
        rope.rebuild("cuda")
        cos, sin = rope.tables(torch.tensor([0, 3, 7, 200, 255], device="cuda"), dtype)
        qkv = randn(5, (hq + 2 * hk) * d)
        view = qkv[:, : (hq + hk) * d].view(5, hq + hk, d)
        expect = torch.addcmul(view.float() * cos.float(), view.float().roll(d // 2, dims=-1), sin.float())
        v = qkv[:, (hq + hk) * d :].clone()
        RotaryEmbedding.apply(view, cos, sin)
        torch.testing.assert_close(qkv[:, : (hq + hk) * d].view(5, hq + hk, d).float(), expect, **close)
        assert torch.equal(qkv[:, (hq + hk) * d :], v)
    for n in (1536, 8192, 100):
        gate_up = randn(3, 2 * n)
        gate, up = gate_up.float().chunk(2, dim=-1)
        torch.testing.assert_close(triton_ops.silu_mul(gate_up).float(), F.silu(gate) * up, **close)


def test_fused_layer_ops_give_the_torch_paths_tokens(tmp_path, monkeypatch):
    """A CUDA forward with the fused kernels and one with torch's operations alone
    (SHOAL_NO_KERNELS) decode the same greedy tokens, with log-probabilities within 1e-4 (fp32)."""
    make_random_checkpoint("llama", tmp_path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    runs = []
    monkeypatch.delenv("SHOAL_NO_KERNELS", raising=False)
    for torch_only in (False, True):
        if torch_only:
            monkeypatch.setenv("SHOAL_NO_KERNELS", "1")
        loaded = load_model(str(tmp_path), device="cuda", quantization="none")
        llm = LLM(loaded=loaded, device="cuda", num_blocks=64, max_num_seqs=8)
        runs.append(llm.generate(_prompts(), params))
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4


def _attention_by_hand(q, k_cache, v_cache, tables, lens, block_size, window, scale):
    """Softmax attention of each row's query heads over its context, gathered slot by slot."""
    rows, hq, _ = q.shape
    group = hq // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(rows):
        n = int(lens[b])
        pos = torch.arange(max(n - window, 0) if window else 0, n, device=q.device)
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        k, v = k_cache[slots].float(), v_cache[slots].float()
        for h in range(hq):
            weights = torch.softmax((k[:, h // group] @ q[b, h].float()) * scale, dim=0)
            out[b, h] = weights @ v[:, h // group]
    return out


@pytest.mark.parametrize(
    "hq, hk, dim, block_size, window, dtype, kv_dtype",
    [
        (32, 8, 64, 16, None, torch.float32, torch.float32),  # tiles of 64 positions, 4 blocks each
        (9, 3, 64, 16, 8, torch.float32, torch.float32),  # a group of 3, a window inside a tile
        (4, 2, 80, 8, None, torch.float32, torch.float16),  # a head size that is no power of two
        (4, 2, 80, 8, 20, torch.bfloat16, torch.bfloat16),
        (8, 8, 128, 32, 100, torch.bfloat16, torch.bfloat16),  # tiles of 128, a window across them
        (4, 2, 64, 16, 1, torch.float32, torch.float32),  # a window of one: the cache adds nothing
    ],
)
@pytest.mark.parametrize("writes_new", [False, True])
def test_paged_decode_kernel_matches_attention_by_hand(
    hq, hk, dim, block_size, window, dtype, kv_dtype, writes_new
):
    """The Triton decode kernel over scattered blocks (contexts of 1 to 300 positions, tiles that
    span several blocks, tables that hold garbage past each row's blocks), reading every position
    from the cache or writing the step's own K/V there first (from strided views of one q/k/v
    buffer) and taking them from registers."""
    from shoal.kernels.triton_attention import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.tensor([1, 3, 16, 17, 70, 300], dtype=torch.int64, device="cuda")
    rows, width = len(lens), -(-300 // block_size)
    tables = torch.randperm(rows * width + 1, generator=g, device="cuda")[: rows * width].view(rows, width)
    for b, n in enumerate(lens.tolist()):  # past a row's blocks: ids no pool has (never to be read)
        tables[b, -(-n // block_size) :] = 1 << 40
    slots_total = (rows * width + 1) * block_size

    def randn(*shape, dt):
        return torch.randn(*shape, generator=g, device="cuda").to(dt)

    k_cache, v_cache = randn(slots_total, hk, dim, dt=kv_dtype), randn(slots_total, hk, dim, dt=kv_dtype)
    qkv = randn(rows, hq + 2 * hk, dim, dt=dtype)
    q, k_new, v_new = qkv.split([hq, hk, hk], dim=1)
    pos = lens - 1
    slots = tables[torch.arange(rows, device="cuda"), pos // block_size] * block_size + pos % block_size
    scale = dim**-0.5
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    if writes_new:
        expect_k[slots], expect_v[slots] = k_new.to(kv_dtype), v_new.to(kv_dtype)
    expect = _attention_by_hand(q, expect_k, expect_v, tables, lens, block_size, window, scale)
    new_kv = (k_new, v_new, slots) if writes_new else None
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, window, scale, new_kv=new_kv)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    close = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), expect, **close)


def test_greedy_steps_decided_ahead_on_cuda_match_eager_steps(tmp_path):
    """Graph replays with each greedy step's successor queued before its tokens are read (rows of
    different lengths ending apart, more requests than the batch holds so others join) give the
    tokens of eager steps, which decide nothing ahead; most queued steps are used."""
    make_random_checkpoint("llama", tmp_path)
    prompts = _prompts((3, 5, 17, 40, 70))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 33, 47, 21, 36)]
    runs = []
    for eager in (True, False):
        loaded = load_model(str(tmp_path), device="cuda", quantization="none")
        llm = LLM(loaded=loaded, device="cuda", num_blocks=128, enforce_eager=eager, max_num_seqs=3)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert (llm.engine.core.executor.runner.ahead is None) == eager
        assert_pool_whole(llm.engine)
    assert runs[0] == runs[1]
    stats = llm.engine.stats()
    taken, dropped = stats.steps_from_queue, stats.queued_steps_dropped
    assert taken > 45 and taken > 4 * dropped, (taken, dropped)
