"""The engine gives HF's greedy outputs however it is squeezed: chunked prefill, preemption, prefix
reuse, late arrivals, aborts, n>1. After every test the KV pool is whole again."""

from __future__ import annotations

import pytest

from shoal import SamplingParams
from shoal.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from shoal.engine.llm_engine import LLMEngine, RequestRejectedError
from tests.conftest import REF_TOKENS
from tests.helpers import PROMPTS, assert_pool_whole, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=REF_TOKENS, ignore_eos=True)


def make_engine(bundled, num_blocks=256, budget=2048, max_seqs=64, **cache) -> LLMEngine:
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=num_blocks, **cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
    )
    return LLMEngine(cfg, loaded=bundled)


def check_outputs(done, reference, ids_to_prompt):
    for rid, prompt in ids_to_prompt.items():
        assert done[rid].outputs[0].token_ids == reference[prompt][1], prompt


def test_chunked_prefill_with_a_16_token_budget(bundled, reference):
    engine = make_engine(bundled, budget=16)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), reference[p][0], GREEDY)
    done = run_to_completion(engine)
    check_outputs(done, reference, {str(i): p for i, p in enumerate(PROMPTS)})
    # The prompts really were chunked.
    assert engine.core.num_steps > sum(len(reference[p][0]) for p in PROMPTS) // 16
    assert_pool_whole(engine)


def test_preemption_by_recompute_keeps_outputs(bundled, reference):
    # 12 blocks of 16 slots cannot hold the 8 requests (~ 8 * 3-5 blocks) at once.
    engine = make_engine(bundled, num_blocks=12)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), reference[p][0], GREEDY)
    done = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0
    check_outputs(done, reference, {str(i): p for i, p in enumerate(PROMPTS)})
    assert_pool_whole(engine)


def test_shared_prefix_skips_its_prefill(bundled, reference):
    engine = make_engine(bundled)
    long_prompt = PROMPTS[6]
    ids = reference[long_prompt][0]
    engine.add_request("first", ids, GREEDY)
    done = run_to_completion(engine)
    engine.add_request("second", ids, GREEDY)
    done.update(run_to_completion(engine))
    check_outputs(done, reference, {"first": long_prompt, "second": long_prompt})
    # Every full block of the prompt except the one holding its last token comes from the cache.
    expected = (len(ids) - 1) // 16 * 16
    assert done["second"].num_cached_tokens == expected > 0
    stats = engine.stats()
    assert stats.prefix_hits == expected
    assert stats.prefix_queries == 2 * len(ids)
    assert_pool_whole(engine)


def test_prefix_shared_by_a_different_continuation(bundled):
    engine = make_engine(bundled)
    tok = bundled.tokenizer
    base = tok.encode(PROMPTS[6])
    engine.add_request("a", base + tok.encode(" First,"), GREEDY)
    run_to_completion(engine)
    engine.add_request("b", base + tok.encode(" Second, consider"), GREEDY)
    done = run_to_completion(engine)
    assert done["b"].num_cached_tokens == len(base) // 16 * 16
    assert_pool_whole(engine)


def test_requests_arriving_while_others_decode(bundled, reference):
    engine = make_engine(bundled)
    pending = list(enumerate(PROMPTS))
    done = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # one new request every third step
            i, p = pending.pop(0)
            engine.add_request(str(i), reference[p][0], GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    check_outputs(done, reference, {str(i): p for i, p in enumerate(PROMPTS)})
    assert_pool_whole(engine)


def test_abort_mid_flight_frees_everything(bundled, reference):
    engine = make_engine(bundled, budget=32)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), reference[p][0], GREEDY)
    done = {}
    for _ in range(6):  # some requests mid-prefill, some decoding
        for out in engine.step():
            done[out.request_id] = out
    assert engine.core.kv.pool.usage > 0
    for i in (0, 3, 6):
        assert engine.abort_request(str(i))
    assert not engine.abort_request("no-such-request")
    done.update(run_to_completion(engine))
    check_outputs(done, reference, {str(i): p for i, p in enumerate(PROMPTS) if i not in (0, 3, 6)})
    assert_pool_whole(engine)


def test_n_greater_than_one_shares_prompt_blocks(bundled, reference):
    engine = make_engine(bundled)
    prompt = PROMPTS[6]
    ids = reference[prompt][0]
    engine.add_request("g", ids, SamplingParams(n=3, temperature=0, max_tokens=REF_TOKENS, ignore_eos=True))
    done = run_to_completion(engine)
    outs = done["g"].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(o.token_ids == reference[prompt][1] for o in outs)
    # The two forked children computed only the prompt's last partial block, not the whole prompt.
    assert engine.core.kv.prefix_queries == len(ids)
    assert_pool_whole(engine)


def test_n_with_sampling_gives_distinct_seeded_choices(bundled):
    engine = make_engine(bundled)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    engine.add_request("g", "Tell me a story about", params)
    first = [o.token_ids for o in run_to_completion(engine)["g"].outputs]
    engine.add_request("h", "Tell me a story about", params)
    second = [o.token_ids for o in run_to_completion(engine)["h"].outputs]
    assert first == second
    assert len({tuple(t) for t in first}) == 3
    assert_pool_whole(engine)


def test_seeded_request_is_batch_invariant(bundled):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = make_engine(bundled)
    alone.add_request("x", PROMPTS[1], params)
    expected = run_to_completion(alone)["x"].outputs[0].token_ids
    crowded = make_engine(bundled, budget=64)
    for i, p in enumerate(PROMPTS):
        crowded.add_request(f"other-{i}", p, SamplingParams(temperature=1.0, max_tokens=30))
    crowded.add_request("x", PROMPTS[1], params)
    assert run_to_completion(crowded)["x"].outputs[0].token_ids == expected
    assert_pool_whole(crowded)


def test_higher_priority_request_preempts_lower(bundled, reference):
    engine = make_engine(bundled, num_blocks=8)
    low = reference[PROMPTS[6]][0]
    engine.add_request("low", low, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True), priority=5)
    while engine.core.kv.pool.num_free_blocks > 1:  # let the low-priority request fill the pool
        engine.step()
    high = reference[PROMPTS[1]][0]
    engine.add_request("high", high, GREEDY, priority=0)
    done = {}
    order = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
                order.append(out.request_id)
    assert order == ["high", "low"]
    assert engine.stats().num_preemptions >= 1
    assert done["high"].outputs[0].token_ids == reference[PROMPTS[1]][1]
    assert_pool_whole(engine)


@pytest.mark.parametrize(
    "prompt_len, max_tokens, param",
    [(300, 10, "prompt"), (200, 100, "max_tokens"), (0, 10, "prompt")],
)
def test_impossible_requests_are_refused_at_once(bundled, prompt_len, max_tokens, param):
    engine = make_engine(bundled, num_blocks=16)  # 256 slots: max_model_len becomes 256
    assert engine.max_model_len == 256
    with pytest.raises(RequestRejectedError) as e:
        engine.add_request("x", [500] * prompt_len, SamplingParams(max_tokens=max_tokens))
    assert e.value.param == param
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", [500] * 20, SamplingParams(max_tokens=4))  # the engine still serves
    run_to_completion(engine)
    assert_pool_whole(engine)


def test_out_of_vocabulary_and_duplicate_ids_are_refused(bundled):
    engine = make_engine(bundled)
    with pytest.raises(RequestRejectedError):
        engine.add_request("x", [1, 2, 10**9], SamplingParams())
    engine.add_request("dup", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(RequestRejectedError):
        engine.add_request("dup", "hi", SamplingParams(max_tokens=2))
    run_to_completion(engine)
    assert_pool_whole(engine)


def test_kv_events_report_stores_and_evictions(bundled, reference):
    engine = make_engine(bundled, num_blocks=12, enable_kv_events=True)
    engine.add_request("a", reference[PROMPTS[6]][0], GREEDY)
    run_to_completion(engine)
    stored = [e for e in engine.take_kv_events() if e.kind == "stored"]
    assert len(stored) == (len(reference[PROMPTS[6]][0]) + REF_TOKENS - 1) // 16
    assert stored[0].parent_hash is None and stored[1].parent_hash == stored[0].block_hash
    engine.add_request("b", reference[PROMPTS[1]][0], SamplingParams(temperature=0, max_tokens=120))
    run_to_completion(engine)
    removed = {e.block_hash for e in engine.take_kv_events() if e.kind == "removed"}
    assert removed & {e.block_hash for e in stored}  # the pool was small: old blocks were evicted
    assert_pool_whole(engine)


def test_prompt_logprobs_match_hf_even_with_a_warm_prefix_cache(bundled, hf_bundled, reference):
    import torch

    prompt = max(PROMPTS, key=lambda p: len(reference[p][0]))
    ids = reference[prompt][0]
    with torch.inference_mode():
        hf = torch.log_softmax(hf_bundled(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    engine = make_engine(bundled, budget=16)  # prompt rows arrive over several chunks
    engine.add_request("warm", ids, GREEDY)  # fills the prefix cache with this prompt's blocks
    run_to_completion(engine)
    engine.add_request("p", ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    out = run_to_completion(engine)["p"]
    assert out.num_cached_tokens == 0  # the cache was bypassed: every prompt row was computed
    lps = out.prompt_logprobs
    assert lps[0] is None and len(lps) == len(ids)
    for pos in range(1, len(ids)):
        lp = lps[pos]
        assert lp.token_id == ids[pos]
        assert abs(lp.logprob - float(hf[pos - 1, ids[pos]])) < 2e-3
        assert lp.rank == int((hf[pos - 1] > hf[pos - 1, ids[pos]]).sum()) + 1
        assert [t for t, _ in lp.top] == hf[pos - 1].topk(3).indices.tolist()
    assert_pool_whole(engine)


def test_a_resumed_request_its_grammar_refuses_fails_alone(bundled, reference):
    """The runner takes a new request's state in the step; a resumed output its grammar cannot
    have produced fails that request only, and the one beside it runs exactly as alone."""
    from shoal.engine.structured import StructuredOutput

    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=128)), loaded=bundled)
    ids, ref_tokens, _ = reference[PROMPTS[0]]
    engine.add_request("ok", ids, SamplingParams(temperature=0, max_tokens=REF_TOKENS, ignore_eos=True))
    bad = engine.tokenizer.encode("plain words", add_special_tokens=False)
    grammar = SamplingParams(max_tokens=8, structured=StructuredOutput("json_object"))
    engine.add_request("bad", ids, grammar, prior_output_ids=bad)
    done = run_to_completion(engine)
    assert done["bad"].error and done["bad"].outputs[0].finish_reason == "error"
    assert done["ok"].outputs[0].token_ids == ref_tokens and done["ok"].error is None
    assert_pool_whole(engine)
