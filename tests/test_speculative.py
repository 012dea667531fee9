"""Speculative decoding on the real model: greedy gives the tokens plain decoding gives (checked
against HF fp32), sampling follows the model's distribution exactly (a statistical test at a
fixed context), and everything else the engine does still holds with proposals riding along."""

from __future__ import annotations

import math

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.engine.sampler import Sampler, SamplingState
from shoal.engine.speculative import ngram_lookup
from tests.conftest import REF_TOKENS
from tests.helpers import PROMPTS, assert_pool_whole
from tests.server_helpers import start_server

REPEAT = (
    "Rewrite this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank. "
    "Rewrite: The quick brown fox jumps over the lazy dog near the river bank. Rewrite:"
)


def test_ngram_lookup_continues_the_latest_longest_match():
    ctx = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert ngram_lookup(ctx, 3, 4, 1) == [7, 8, 2]  # "2 3 4" last seen before 7 8
    assert ngram_lookup([1, 2, 3, 1, 2], 2, 1, 1) == [3, 1]  # the suffix "2" alone
    assert ngram_lookup([5, 6, 7], 3, 4, 1) == []  # nothing repeats
    assert ngram_lookup([4, 4], 3, 2, 1) == [4]
    assert ngram_lookup([1, 2, 3, 1, 2, 3], 2, 4, 2) == [1, 2]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_gives_the_tokens_of_plain_decoding(bundled, reference, method):
    """The HF-parity prompts, all in one batch, on the fp32 target (the draft: the same model in
    int4): every token as HF fp32 greedy gives it, or, where the verify pass's batch shape moves a
    near-tie, HF's top two differ there by under 1e-4."""
    # Proposals for all 8 at once (by default a draft stops proposing past 4 requests a step).
    spec = dict(speculative=method, num_speculative_tokens=4, speculative_disable_by_batch_size=8)
    llm = LLM(loaded=bundled, num_blocks=512, **spec)
    params = SamplingParams(temperature=0, max_tokens=REF_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate([reference[p][0] for p in PROMPTS], params)
    for p, out in zip(PROMPTS, outs):
        _, ref_tokens, ref_logprobs = reference[p]
        got = out.outputs[0].token_ids
        assert len(got) == REF_TOKENS and len(out.outputs[0].logprobs) == REF_TOKENS
        diff = next((i for i, (a, b) in enumerate(zip(got, ref_tokens)) if a != b), None)
        if diff is not None:
            top2 = ref_logprobs[diff].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-4, (p, diff)
        for i, lp in enumerate(out.outputs[0].logprobs[: diff if diff is not None else REF_TOKENS]):
            assert abs(lp.logprob - float(ref_logprobs[i, lp.token_id])) < 2e-3
    stats = llm.engine.core.spec_stats
    assert stats.num_drafts > 10 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    if method == "draft":  # int4 against fp32 of the same weights: they mostly agree
        assert stats.acceptance_rate > 0.6
        llm.engine.step()  # the runners hear of finished requests at the next step
        draft = llm.engine.core.executor.runner.proposer
        assert not draft.tables and len(draft.free_blocks) == draft.runner.num_blocks  # all given back
        capped = LLM(loaded=bundled, num_blocks=512, speculative=method, num_speculative_tokens=4)
        outs = capped.generate([reference[p][0] for p in PROMPTS[:5]], params)
        assert capped.engine.core.spec_stats.num_drafts == 0  # 5 at a time: past the default cap
        assert [o.outputs[0].token_ids for o in outs] == [reference[p][1] for p in PROMPTS[:5]]
    assert_pool_whole(llm.engine)


COPY = (
    "Repeat this text exactly, word for word: The old lighthouse keeper climbed the spiral stairs "
    "every evening at dusk, lit the great lamp, and watched the ships pass safely through the strait."
)


def test_speculation_saves_forward_passes_where_text_repeats(bundled):
    params = SamplingParams(temperature=0, max_tokens=60)
    plain = LLM(loaded=bundled, num_blocks=256)
    spec = LLM(loaded=bundled, num_blocks=256, speculative="ngram", num_speculative_tokens=5)
    ids = bundled.tokenizer.encode_chat([{"role": "user", "content": COPY}])
    a = plain.generate(ids, params)[0].outputs[0]
    b = spec.generate(ids, params)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text and "lighthouse keeper" in b.text
    # Far fewer forward passes than tokens: most guesses were right.
    assert plain.engine.core.num_steps == len(a.token_ids)  # one a step (the prefill samples the first)
    assert spec.engine.core.num_steps < plain.engine.core.num_steps * 0.5
    assert spec.engine.core.spec_stats.acceptance_rate > 0.5
    per_pos = spec.engine.core.spec_stats.accepted_per_position
    assert per_pos[0] >= per_pos[-1] > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_keeps_every_engine_feature(bundled, method):
    """Chunked prefill, a tiny pool (preemption), n > 1, logprobs, stop strings, max_tokens and
    seeds, with proposals riding along."""
    small = dict(num_blocks=12, block_size=16, max_num_batched_tokens=48)
    spec = LLM(loaded=bundled, speculative=method, num_speculative_tokens=3, **small)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [REPEAT, PROMPTS[1], PROMPTS[6], REPEAT + " The quick"]
    plain = LLM(loaded=bundled, num_blocks=512)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    got = spec.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == want
    assert spec.engine.core.scheduler.num_preemptions > 0  # the pool was too small for all at once
    assert_pool_whole(spec.engine)

    big = LLM(loaded=bundled, num_blocks=256, speculative=method, num_speculative_tokens=4)
    sampled = SamplingParams(temperature=0.8, seed=11, n=3, max_tokens=17, logprobs=2, ignore_eos=True)
    (out,) = big.generate(REPEAT, sampled)
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert len(o.token_ids) == 17 and len(o.logprobs) == 17 and o.finish_reason == "length"
        assert [lp.token_id for lp in o.logprobs] == o.token_ids
    (again,) = big.generate(REPEAT, sampled)
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]  # seeded

    # Abort mid-flight, proposals outstanding: everything is given back.
    big.engine.add_request("gone", REPEAT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        big.engine.step()
    assert big.engine.abort_request("gone")
    big.engine.step()
    assert_pool_whole(big.engine)

    stop = SamplingParams(temperature=0, max_tokens=60, stop=["lazy"])
    (s,) = big.generate(REPEAT, stop)
    text = s.outputs[0].text
    assert s.outputs[0].finish_reason == "stop" and "lazy" not in text and text
    assert big.tokenizer.decode(s.outputs[0].token_ids).rstrip().endswith("lazy")
    assert_pool_whole(big.engine)


def test_rejection_sampling_follows_the_models_distribution(bundled, hf_bundled):
    """At a fixed context, the first token of a verified step is distributed as the model's own
    next-token distribution, whatever the proposal (a likely guess or an unlikely one), and the
    token after an accepted guess as the model's distribution there. Logits from HF fp32, cut to
    the tokens that can matter (top_k 6 of each row lies within its top 64) to keep 18,000 draws
    fast."""
    ids = bundled.tokenizer.encode("My favourite colour is")
    params = SamplingParams(temperature=1.0, top_k=6)
    base = _hf_logits(hf_bundled, ids, [])
    ranked = base[0].argsort(descending=True).tolist()
    cases = [[ranked[0], ranked[1]], [ranked[4], ranked[0]]]
    full = [_hf_logits(hf_bundled, ids, d) for d in cases]
    keep = sorted({t for rows in full for row in rows for t in row.topk(64).indices.tolist()})
    where = {t: i for i, t in enumerate(keep)}
    sampler = Sampler(frozenset(), len(keep))
    trials = 3000
    for drafts, rows in zip(cases, full):
        rows = rows[:, keep]
        drafts = [where[t] for t in drafts]
        p0 = _target(rows[0], params)
        first, second = torch.zeros_like(p0), torch.zeros_like(p0)
        for seed in range(trials):
            toks = sampler.verify(rows, SamplingState(params, seed, ids), drafts)
            first[toks[0]] += 1
            if toks[0] == drafts[0]:
                second[toks[1]] += 1
        _assert_matches(first, p0, trials)
        _assert_matches(second, _target(rows[1], params), int(second.sum()))
        # And plain sampling, the reference the speculative path must equal.
        plain = torch.zeros_like(p0)
        for seed in range(trials):
            plain[sampler(rows[:1], [SamplingState(params, seed, ids)])[0]] += 1
        _assert_matches(plain, p0, trials)


def _hf_logits(hf, ids: list[int], drafts: list[int]) -> torch.Tensor:
    """HF's logits at the context's last position and after each draft."""
    with torch.inference_mode():
        return hf(torch.tensor([ids + drafts])).logits[0, len(ids) - 1 :].float()


def _target(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return Sampler._filtered_probs(row.unsqueeze(0).float(), [params])[0]


def _assert_matches(counts: torch.Tensor, p: torch.Tensor, n: int) -> None:
    """Each token's frequency within 4.5 standard errors of its probability, and no mass where
    the model puts none."""
    freq = counts / n
    assert float(freq[p == 0].sum()) == 0
    for t in torch.nonzero(p > 0).flatten().tolist():
        se = math.sqrt(float(p[t]) * (1 - float(p[t])) / n)
        assert abs(float(freq[t] - p[t])) <= 4.5 * se + 1e-9, (t, float(freq[t]), float(p[t]))


@pytest.mark.parametrize("k", [1, 3])
def test_spec_decode_counters_count_accepted_tokens_by_position(k):
    from shoal.engine.speculative import SpecDecodeStats

    s = SpecDecodeStats(k)
    s.observe({"a": (k, k), "b": (k, 0)})
    assert s.num_drafts == 2 and s.num_draft_tokens == 2 * k and s.num_accepted_tokens == k
    assert s.accepted_per_position == [1] * k and s.acceptance_rate == 0.5


def test_a_speculating_server_exports_its_counters():
    server = start_server("--speculative", "ngram", "--kv-cache-memory", "128MiB", "--max-model-len", "512")
    try:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": COPY}],
            "max_tokens": 40,
        }
        r = server.post("/v1/chat/completions", json={**body, "temperature": 0})
        assert r.status_code == 200 and "lighthouse" in r.json()["choices"][0]["message"]["content"]
        page = server.get("/metrics").text
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("shoal:spec_decode") and 'position="' not in line
        }
        assert (
            values["shoal:spec_decode_num_draft_tokens_total"]
            >= values["shoal:spec_decode_num_accepted_tokens_total"]
            > 5
        )
        assert values["shoal:spec_decode_num_drafts_total"] > 0
        assert (
            'shoal:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2-135M-Instruct",position="0"}'
            in page
        )
    finally:
        server.stop()
