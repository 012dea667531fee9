"""Tensor and pipeline parallelism: real worker processes over torch.distributed on 127.0.0.1,
checked against the single-process engine and HF transformers."""

from __future__ import annotations

import os

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.models.loader import load_model
from shoal.models.parallel import ModelShard, ShardingError, all_shards, check_parallel_sizes
from tests.conftest import REF_TOKENS
from tests.helpers import PROMPTS, assert_pool_whole, closeness_to_reference, hf_greedy
from tests.test_hf_parity import make_random_checkpoint

LOGIT_ATOL = 1e-4


def _parallel_pids(parent: int | None = None) -> set[int]:
    """Pids of rank processes on this machine, or only of those `parent` started (other test
    sessions may run engines beside this one)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"shoal.engine.parallel.worker" in cmd and parent in (None, ppid):
            pids.add(int(entry))
    return pids


def _greedy(llm, prompts, n=REF_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def _assert_same(outs, ref_outs):
    """Same tokens, and every top-5 logprob within LOGIT_ATOL of the single-process engine's."""
    for out, ref in zip(outs, ref_outs):
        assert out.token_ids == ref.token_ids
        for lp, ref_lp in zip(out.logprobs, ref.logprobs):
            mine, theirs = dict(lp.top), dict(ref_lp.top)
            assert mine.keys() == theirs.keys()
            for tok, value in mine.items():
                assert abs(value - theirs[tok]) < LOGIT_ATOL, (tok, value, theirs[tok])


# --- the split --------------------------------------------------------------------------


def test_bundled_model_splits_by_whole_kv_groups(bundled):
    cfg = bundled.config
    assert (cfg.num_heads, cfg.num_kv_heads) == (9, 3)
    two = all_shards(cfg, 2, 1)
    assert [(s.q_heads.size, s.kv_heads.size) for s in two] == [(6, 2), (3, 1)]  # uneven, whole groups
    three = all_shards(cfg, 3, 1)
    assert [(s.q_heads.start, s.kv_heads.start) for s in three] == [(0, 0), (3, 1), (6, 2)]
    assert sum(s.intermediate.size for s in two) == cfg.intermediate_size
    assert all(s.intermediate.size % 32 == 0 for s in two + three)  # quantized blocks stay whole
    nine = all_shards(cfg, 9, 1)  # more ranks than KV heads: each KV head on three ranks
    assert [s.kv_heads.start for s in nine] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    stages = all_shards(cfg, 1, 2)
    assert [s.layers.size for s in stages] == [15, 15]
    assert stages[0].local_name("model.layers.20.mlp.up_proj.weight") is None
    assert stages[1].local_name("model.layers.20.mlp.up_proj.weight") == "model.layers.5.mlp.up_proj.weight"
    assert stages[0].local_name("model.norm.weight") is None
    with pytest.raises(ShardingError, match=r"cannot split 9 query heads and 3 KV heads.*\[2, 3, 9\]"):
        check_parallel_sizes(cfg, 4, 1)
    with pytest.raises(ShardingError, match="exceeds the model's 30 layers"):
        check_parallel_sizes(cfg, 1, 31)


def test_sharded_reads_are_slices_of_the_whole_checkpoint(bundled, tmp_path):
    """Each rank's weights, read from the GGUF cache by slices, are the whole model's rows and
    columns; put back together they are the whole."""
    whole = dict(bundled.model.named_parameters())
    parts = [load_model(quantization="none", parallel=(r, 2, 0, 1), comm=_NoComm()) for r in range(2)]
    p0, p1 = (dict(p.model.named_parameters()) for p in parts)
    name = "layers.3.qkv_proj.weight"
    d = bundled.config.head_dim
    q = bundled.config.q_size
    w = whole[name]
    assert torch.equal(p0[name][: 6 * d], w[: 6 * d]) and torch.equal(p1[name][: 3 * d], w[6 * d : q])
    assert torch.equal(p0[name][6 * d : 8 * d], w[q : q + 2 * d])  # its two K heads
    assert torch.equal(p1[name][-d:], w[-d:])  # the last V head
    o = "layers.3.o_proj.weight"
    assert torch.equal(torch.cat([p0[o], p1[o]], dim=1), whole[o])
    down = "layers.7.down_proj.weight"
    assert torch.equal(torch.cat([p0[down], p1[down]], dim=1), whole[down])
    emb = "embed_tokens.weight"
    assert torch.equal(torch.cat([p0[emb], p1[emb]])[: bundled.config.vocab_size], whole[emb])


class _NoComm:
    """Stands in for the collectives when only loading is looked at (nothing runs a forward)."""

    world_size = 2

    def all_reduce(self, t):
        raise AssertionError("no forward runs in this test")

    all_gather = all_reduce


# --- the bundled model end to end -------------------------------------------------------


@pytest.fixture(scope="module")
def single(bundled, reference):
    llm = LLM(loaded=bundled, num_blocks=512)
    outs = _greedy(llm, [reference[p][0] for p in PROMPTS])
    return outs


@pytest.mark.parametrize("tp,pp,spec", [(2, 1, None), (1, 2, None), (2, 2, None), (1, 2, "ngram")])
def test_fp32_output_equals_one_process(tp, pp, spec, single, reference):
    opts = dict(speculative=spec, num_speculative_tokens=3) if spec else {}
    split = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    with LLM(quantization="none", num_blocks=512, **split, **opts) as llm:
        outs = _greedy(llm, [reference[p][0] for p in PROMPTS])
        _assert_same(outs, single)
        for p, out in zip(PROMPTS, outs):
            assert out.token_ids == reference[p][1], p  # and HF's
        assert_pool_whole(llm.engine)
    assert not _parallel_pids(os.getpid())


@pytest.mark.parametrize("method,tp", [("int4", 2), ("int8", 3)])
def test_quantized_under_tp_stays_as_close_to_fp32(method, tp, reference):
    budget = 40 * 737_280  # 40 blocks of the whole model's KV (30 layers x 3 heads x 64 x 16 x 2 x 4 B)
    one = LLM(quantization=method, kv_cache_memory=budget)
    assert one.engine.core.kv.pool.num_blocks == 40
    base = closeness_to_reference(one, reference, 8)
    with LLM(quantization=method, kv_cache_memory=budget, tensor_parallel_size=tp) as llm:
        split = closeness_to_reference(llm, reference, 8)
        # The budget is per rank, and a rank holds only its KV heads: 3 ranks of one head each hold
        # 3 times the blocks; 2 ranks (2 heads and 1) 1.5 times.
        assert llm.engine.core.kv.pool.num_blocks == {2: 60, 3: 120}[tp]
    print(f"\n{method}: TP=1 {base}\n{method}: TP={tp} {split}")
    assert split["agreement"] >= base["agreement"] - 0.02
    assert split["mean_error"] <= base["mean_error"] * 1.25 + 1e-3


# --- other architectures (random checkpoints, compared with HF) -------------------------

VARIANTS = {
    # untied head, llama3 rope, 3 KV heads over 2 ranks (2 + 1)
    "llama-uneven": ("llama", dict(num_attention_heads=6, num_key_value_heads=3), 2, 1),
    # qkv bias, tied embeddings, across both kinds of split
    "qwen2-bias": ("qwen2", dict(), 2, 2),
    # q/k norm; one KV head, replicated on both ranks
    "qwen3-norm": ("qwen3", dict(num_key_value_heads=1), 2, 1),
    # sliding window shorter than the prompts; pipeline stages of 2 and 1 layers
    "mistral-window": ("mistral", dict(sliding_window=16), 1, 2),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_random_checkpoint_split_matches_one_process_and_hf(variant, tmp_path):
    arch, overrides, tp, pp = VARIANTS[variant]
    hf = make_random_checkpoint(arch, tmp_path, **overrides)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 17, 40)]
    opts = dict(num_blocks=64, max_num_batched_tokens=64)
    ref = _greedy(LLM(str(tmp_path), **opts), prompts, 10)
    with LLM(str(tmp_path), tensor_parallel_size=tp, pipeline_parallel_size=pp, **opts) as llm:
        outs = _greedy(llm, prompts, 10)
    _assert_same(outs, ref)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)[0]


def test_a_model_that_cannot_split_is_refused_before_any_rank_starts(tmp_path):
    make_random_checkpoint("llama", tmp_path, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ShardingError, match="tensor parallel size 4 cannot split 6 query heads and 3 KV"):
        LLM(str(tmp_path), tensor_parallel_size=4)
    assert not _parallel_pids(os.getpid())


def test_model_shard_is_whole_without_parallelism(bundled):
    shard = ModelShard(bundled.config)
    assert shard.local_config() == bundled.config
    assert shard.slice_of("model.layers.0.self_attn.q_proj.weight") is None


# --- pipeline stages kept busy ----------------------------------------------------------


def test_pipeline_keeps_a_step_per_stage_in_flight_and_isolates_a_failing_request(monkeypatch, single):
    """With two stages, the running requests are spread over two steps in flight (twice the steps
    of one batch a token); a request whose part fails is failed alone, the others are unchanged."""
    monkeypatch.setenv("SHOAL_FAULT_STEP_ERROR_ON", "ZZBADZZ")
    params = SamplingParams(temperature=0, max_tokens=REF_TOKENS, ignore_eos=True, logprobs=5)
    with LLM(quantization="none", num_blocks=512, pipeline_parallel_size=2) as llm:
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        outs = llm.generate([*prompts, "ZZBADZZ and more"], params)
        assert llm.engine.core.num_steps >= 2 * REF_TOKENS
        assert llm.engine.core.scheduler.in_flight == set()
        assert_pool_whole(llm.engine)
    _assert_same([o.outputs[0] for o in outs[:-1]], single)
    assert outs[-1].outputs[0].finish_reason == "error"


def test_sampling_grammars_and_choices_under_tp_equal_one_process():
    """Seeded sampling with n=2, a JSON grammar and prompt logprobs: every sampling rank keeps the
    same state, and the answering rank's tokens are the single process's."""
    from shoal.engine.structured import StructuredOutput

    prompts = ["Write a JSON object about a cat:", "List three colors:"]
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, seed=7, structured=StructuredOutput("json_object")),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=3, n=2, prompt_logprobs=2),
    ]

    def run(llm):
        outs = llm.generate(prompts, params)
        found = []
        for o in outs:
            scored = [(p.token_id, p.logprob) for p in o.prompt_logprobs or [] if p]
            found.append(([c.token_ids for c in o.outputs], scored))
        return found

    want = run(LLM(quantization="none", num_blocks=128))
    with LLM(quantization="none", num_blocks=128, tensor_parallel_size=2) as llm:
        got = run(llm)
    for (g_tokens, g_plp), (w_tokens, w_plp) in zip(got, want):
        assert g_tokens == w_tokens
        assert [t for t, _ in g_plp] == [t for t, _ in w_plp]
        assert all(abs(a - b) < LOGIT_ATOL for (_, a), (_, b) in zip(g_plp, w_plp))


def test_block_slices_from_memory_and_from_the_cache_agree(bundled):
    """A GGUF's quantized blocks cut for a rank the two ways a rank gets them: from the conversion
    cache (a first load without a cache cuts them in memory instead)."""
    from shoal.models.checkpoint import bundled_model_path
    from shoal.models.gguf_cache import load_cached
    from shoal.models.sharded_read import take_blocks

    cached = load_cached(bundled_model_path(), torch.float32)
    whole = cached.blocks()
    assert any(".down_proj." in n for n in whole)  # row-parallel (input dimension) cuts are among them
    for rank in range(2):
        shard = ModelShard(bundled.config, rank, 2)
        from_cache = cached.blocks(shard)
        assert from_cache.keys() == whole.keys()
        for name, b in whole.items():
            got, want = take_blocks(shard, name, b), from_cache[name]
            assert got.format == want.format and torch.equal(got.qs, want.qs), name
            assert torch.equal(got.d, want.d) and (got.mn is None or torch.equal(got.mn, want.mn)), name
