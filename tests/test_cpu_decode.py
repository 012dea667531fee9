"""The fused C decode layer against the model's own forward, on the same paged KV state."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

from shoal.engine.cpu_decode_gate import Refusal, fused_refusal
from shoal.engine.model_runner import ModelRunner
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from shoal.engine.step_inputs import ScheduledChunk
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


class Chunk(NamedTuple):
    """A request's part of a step and its block table (which the runner keeps across steps)."""

    chunk: ScheduledChunk
    blocks: list[int]


def chunk(rid: int, tokens: list[int], start: int, blocks: list[int]) -> Chunk:
    return Chunk(ScheduledChunk(str(rid), tokens, start, sample=True), blocks)


def prepare(runner: ModelRunner, chunks: list[Chunk]):
    for c in chunks:
        runner.tables.put(c.chunk.request_id, c.blocks)
    return runner._prepare([c.chunk for c in chunks], reference_too=True)


FUSED_CASES = [
    (method, overrides, None)
    for method in ("int4", "int8", None)
    for overrides in ({"head_dim": 64}, {"qkv_bias": True, "sliding_window": 5})
] + [(method, {"head_dim": 64}, kv) for method in ("int4", None) for kv in (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("method, overrides, kv_dtype", FUSED_CASES)
@torch.inference_mode()
def test_fused_decode_layers_match_the_model_forward(method, overrides, kv_dtype):
    """The C layer against the model's forward, on weights of each format and caches of each KV
    element type (16-bit caches: both paths round each key and value the same way)."""
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    model = random_model(method, **overrides)
    runner = ModelRunner(model, num_blocks=64, block_size=BS, eos_token_ids=frozenset(), kv_dtype=kv_dtype)
    assert runner.fused_decoder is not None
    g = torch.Generator().manual_seed(1)
    lengths = [3, 9, 30, 70]  # the longest spans several of the attention kernel's key chunks
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]
    free = torch.randperm(64, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-(n + 3) // BS))] for n in lengths]
    attend = lambda md: lambda layer, q, k, v: runner.attention.forward(layer, q, k, v, md)  # noqa: E731

    runner.fused_decoder.max_rows = None  # the kernel, not this CPU's crossover, is under test here

    prefill = [chunk(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))]
    steps = [prefill] + [
        [chunk(i, [7 * i + step], n + step, t) for i, (n, t) in enumerate(zip(lengths, tables))]
        for step in range(3)
    ]
    for scheduled in steps:  # the prompts (rows of several tokens each), then decode steps
        ids, pos, md = prepare(runner, scheduled)
        assert runner.fused_decoder.handles(md)
        expected = model(ids, pos, attend(md))
        caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        for k, v in runner.kv_caches:  # the fused path must write this step's K/V itself
            k[md.slot_mapping] = 0
            v[md.slot_mapping] = 0
        got = runner.fused_decoder.forward(ids, pos, md)
        if kv_dtype is not None and method is None:
            # A last-bit difference before rounding can move a 16-bit key by one of its own steps
            # (2^-11 or 2^-8 of it): the paths agree to the cache's precision, not to float32's.
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
            continue
        if method is not None and (scheduled is prefill or kv_dtype is not None):
            # Over a hundred prompt rows, the last-bit differences between SDPA and the C attention
            # flip the int8 rounding of an activation somewhere, and later rows attend to it: the
            # same computation, compared on the whole rather than element by element.
            assert (got - expected).abs().mean() < 0.01 * expected.abs().mean()
            for (k, v), (k_ref, v_ref) in zip(runner.kv_caches, caches):  # decode on torch's K/V
                k.copy_(k_ref)
                v.copy_(v_ref)
            continue
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
        for (k, v), (k_ref, v_ref) in zip(runner.kv_caches, caches):
            torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "method, kv_dtype", [("int4", None), ("int8", None), (None, None), ("int4", torch.float16)]
)
@torch.inference_mode()
def test_a_token_computes_the_same_bits_in_any_step(method, kv_dtype):
    """A position's hidden state is bit-identical whether it was decoded one token at a time, or
    recomputed as part of a prompt in one chunk or several, beside other requests or alone: what
    preemption by recompute and a gateway's resume on another replica rely on."""
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    model = random_model(method, head_dim=64)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 300, (37,), generator=g).tolist()
    extra = torch.randint(0, 300, (6,), generator=g).tolist()
    full = prompt + extra
    blocks = list(range(-(-len(full) // BS)))
    other = chunk(9, torch.randint(0, 300, (11,), generator=g).tolist(), 0, list(range(40, 43)))

    def run(schedule) -> torch.Tensor:
        """The hidden state of the last position of `full`, running `schedule` (lists of chunks)."""
        runner = ModelRunner(
            model, num_blocks=64, block_size=BS, eos_token_ids=frozenset(), kv_dtype=kv_dtype
        )
        runner.fused_decoder.max_rows = None
        for scheduled in schedule:
            ids, pos, md = prepare(runner, scheduled)
            assert runner.fused_decoder.handles(md)
            hidden = runner.fused_decoder.forward(ids, pos, md)
        rows = [len(c.chunk.token_ids) for c in scheduled]
        last = [c.chunk.request_id for c in scheduled].index("0")
        return hidden[sum(rows[: last + 1]) - 1].clone()

    decoded = run(
        [[chunk(0, prompt, 0, blocks)]] + [[chunk(0, [t], 37 + i, blocks)] for i, t in enumerate(extra)]
    )
    one_chunk = run([[chunk(0, full, 0, blocks)]])
    chunked = run([[chunk(0, full[:20], 0, blocks)], [chunk(0, full[20:], 20, blocks), other]])
    beside = run([[other, chunk(0, full, 0, blocks)]])
    for got in (one_chunk, chunked, beside):
        assert torch.equal(got, decoded)


def test_qk_norm_models_keep_the_model_forward():
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    model = random_model("int4", qk_norm=True)
    runner = ModelRunner(model, num_blocks=8, block_size=BS, eos_token_ids=frozenset())
    assert runner.fused_decoder is None
    assert fused_refusal(model, runner.kv_caches) == Refusal("qk_norm", True)


@dataclasses.dataclass
class SoftcapConfig(ModelConfig):
    """A model feature the fused layer has never heard of (a logit soft-cap, say)."""

    attn_softcap: float | None = None


class LoraLinear(nn.Linear):
    """A projection with a low-rank adapter added to its output: an nn.Linear to isinstance, but not
    what cpu_layer.c computes from its weight."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.load_state_dict(base.state_dict())
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _with_lora(model: LlamaForCausalLM) -> LlamaForCausalLM:
    layer = model.layers[1]
    layer.o_proj = LoraLinear(layer.o_proj)
    return model


def _with_hook(model: LlamaForCausalLM) -> LlamaForCausalLM:
    model.layers[2].post_attention_layernorm.register_forward_hook(lambda _m, _i, out: out * 1.5)
    return model


def _with_unknown_field(model: LlamaForCausalLM) -> LlamaForCausalLM:
    model.cfg = SoftcapConfig(**vars(model.cfg))
    return model


@pytest.mark.parametrize(
    "change, feature",
    [
        (_with_lora, "layers[1].o_proj type"),
        (_with_hook, "layers[2].post_attention_layernorm forward"),
        (_with_unknown_field, "unknown model feature attn_softcap"),
    ],
)
@torch.inference_mode()
def test_a_feature_outside_the_allow_list_keeps_the_model_forward(change, feature):
    """The gate fails closed: an adapter the C layer would skip, a hook it would not call, a config
    field nobody has checked it against. Each takes the model's forward, and the step's hidden
    states are the model's own (with the adapter's or hook's effect), not the C layer's."""
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    model = change(random_model(None, head_dim=64))
    runner = ModelRunner(model, num_blocks=16, block_size=BS, eos_token_ids=frozenset())
    assert runner.fused_decoder is None
    assert fused_refusal(model, runner.kv_caches).feature == feature
    prompts, tables = [[5, 6, 7, 8, 9], [10, 11]], [[0, 1], [2]]
    new = [
        NewRequestData(str(i), p, SamplingParams(temperature=0), 0, block_ids=t)
        for i, (p, t) in enumerate(zip(prompts, tables))
    ]
    scheduled = [ScheduledRequest(str(i), p, 0) for i, p in enumerate(prompts)]
    out = runner.execute(SchedulerOutput(1, scheduled, new))

    reference = ModelRunner(model, num_blocks=16, block_size=BS, eos_token_ids=frozenset())
    ids, pos, md = prepare(reference, [chunk(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))])
    hidden = model(ids, pos, lambda layer, q, k, v: reference.attention.forward(layer, q, k, v, md))
    logits = model.compute_logits(hidden)
    assert out.sampled == {"0": [int(logits[4].argmax())], "1": [int(logits[6].argmax())]}


@pytest.mark.parametrize("rows", [1, 3, 5, 16])
def test_f32_linear_kernel_matches_torch(rows):
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    torch.manual_seed(rows)
    w, x = torch.randn(37, 100), torch.randn(rows, 100)  # K off the kernel's 16-wide step
    torch.testing.assert_close(cpu_kernels().f32_linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_the_bundled_model_passes_the_allow_list_and_matches_its_forward(bundled):
    """The shipped model (Llama, fp32 here; its int4 default is covered by the formats above) is
    inside the allow-list, and the C layer computes its forward on a prompt and a decode step."""
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    model = bundled.model
    runner = ModelRunner(model, num_blocks=8, block_size=16, eos_token_ids=frozenset())
    assert fused_refusal(model, runner.kv_caches) is None
    assert runner.fused_decoder is not None
    runner.fused_decoder.max_rows = None
    prompt = [1, 504, 3458, 282, 4649, 314, 2, 9, 17, 230]
    for scheduled in ([chunk(0, prompt, 0, [0])], [chunk(0, [7], len(prompt), [0])]):
        ids, pos, md = prepare(runner, scheduled)
        caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        expected = model(ids, pos, lambda layer, q, k, v, md=md: runner.attention.forward(layer, q, k, v, md))
        for (k, v), (k_ref, v_ref) in zip(runner.kv_caches, caches):  # the fused path writes its own
            k.copy_(k_ref)
            v.copy_(v_ref)
        got = runner.fused_decoder.forward(ids, pos, md)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
