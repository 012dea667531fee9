"""The runner's state kept across steps (issue 26): block tables held in one tensor and changed by
each step's deltas, penalty counts kept up to date instead of rebuilt. Each is checked against a
plain reference: lists of block ids, penalties computed from the whole history, and a request's
tokens when it runs alone."""

from __future__ import annotations

import random

import torch

from shoal import SamplingParams
from shoal.engine.block_tables import BlockTables
from shoal.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.engine.sampler import Sampler, SamplingState
from tests.helpers import assert_pool_whole, run_to_completion


def test_block_tables_follow_lists_of_block_ids():
    """Random puts, appends and drops, past the first rows and width: every table, padded view and
    slot matches what plain lists of block ids say."""
    rng = random.Random(0)
    tables, model = BlockTables(rows=4, width=2), {}
    bs = 4
    for step in range(2000):
        op = rng.random()
        if op < 0.3 or not model:
            rid = f"r{rng.randrange(200)}"
            model[rid] = [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]
            tables.put(rid, model[rid])
        elif op < 0.8:
            rid = rng.choice(list(model))
            new = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]
            model[rid] += new
            tables.extend(rid, new)
        else:
            rid = rng.choice(list(model))
            del model[rid]
            tables.drop(rid)
        if step % 50:
            continue
        assert len(tables) == len(model)
        live = [r for r in model if model[r]]
        for rid in model:
            assert tables.block_ids(rid) == model[rid]
        if not live:
            continue
        rows = tables.rows(live)
        width = max(len(model[r]) for r in live)
        padded = tables.padded(rows, width * bs, bs)
        assert padded.tolist() == [model[r] + [0] * (width - len(model[r])) for r in live]
        positions = torch.tensor([rng.randrange(len(model[r]) * bs) for r in live])
        expected = [model[r][p // bs] * bs + p % bs for r, p in zip(live, positions.tolist())]
        assert tables.slots(rows, positions, bs).tolist() == expected
    assert tables.table.shape[0] > 4 and tables.table.shape[1] > 2  # it grew both ways


def test_penalties_kept_up_to_date_equal_penalties_from_the_whole_history():
    """Counts kept across steps, through a rollback, against the formula on the full output."""
    vocab, rng = 40, random.Random(1)
    params = SamplingParams(
        temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25
    )
    sampler = Sampler(frozenset({3}), vocab)
    state = SamplingState(params, 0, [5, 6, 7, 5], [])
    for step in range(60):
        logits = torch.randn(1, vocab)
        expected = logits[0].clone()
        out = state.output_token_ids
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[[5, 6, 7]] = True
        counts = torch.zeros(vocab)
        for t in out:
            counts[t] += 1
            seen[t] = True
        expected = torch.where(seen, torch.where(expected > 0, expected / 1.3, expected * 1.3), expected)
        expected -= 0.4 * counts + 0.25 * (counts > 0).float()
        got = logits.clone()
        sampler._apply_penalties(got, [state])
        torch.testing.assert_close(got[0], expected, rtol=0, atol=1e-6)
        if step % 17 == 16:  # a failed step's retry rolls the output back
            state.follow(len(state.prompt_token_ids) + len(out) - 3, [out[-3]])
        else:
            state.advance([rng.randrange(vocab)])


def engine_of(bundled, num_blocks: int, **scheduler) -> LLMEngine:
    cfg = EngineConfig(cache=CacheConfig(num_blocks=num_blocks), scheduler=SchedulerConfig(**scheduler))
    return LLMEngine(cfg, loaded=bundled)


def test_a_squeezed_busy_engine_gives_each_request_its_tokens_alone(bundled):
    """Seeded sampling, penalties, n=2, logprobs and greedy side by side, in a pool small enough to
    preempt, a token budget that chunks prompts beside decodes, late arrivals and an abort: every
    request's tokens are the ones it gets running alone in an engine of its own."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (9, 70, 23, 41, 120, 5, 33)]
    kinds = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=36, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, top_p=0.9, seed=5, n=2, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=44, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=1.0,
            top_k=20,
            seed=2,
            max_tokens=28,
            ignore_eos=True,
            repetition_penalty=1.2,
            presence_penalty=0.3,
        ),
        SamplingParams(temperature=0.8, seed=9, max_tokens=40, ignore_eos=True, min_tokens=10),
        SamplingParams(temperature=0, max_tokens=38, ignore_eos=True),
    ]
    busy = engine_of(bundled, 20, max_num_batched_tokens=48, max_num_seqs=6)
    for i in range(4):
        busy.add_request(str(i), prompts[i], kinds[i])
    done, steps = {}, 0
    while busy.has_unfinished_requests():
        steps += 1
        if steps == 6:  # late arrivals, and one abort, while the first are mid-way
            for i in range(4, 7):
                busy.add_request(str(i), prompts[i], kinds[i])
            busy.add_request("gone", prompts[0], kinds[0])
        if steps == 9:
            busy.abort_request("gone")
        for out in busy.step():
            if out.finished:
                done[out.request_id] = out
    assert busy.stats().num_preemptions > 0  # the pool really was short
    assert "gone" not in done
    assert_pool_whole(busy)
    for i, (prompt, params) in enumerate(zip(prompts, kinds)):
        alone = engine_of(bundled, 64, max_num_batched_tokens=2048, max_num_seqs=8)
        alone.add_request(str(i), prompt, params)
        solo = run_to_completion(alone)[str(i)]
        got = done[str(i)]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in solo.outputs], i
        if params.logprobs:
            for a, b in zip(got.outputs[0].logprobs, solo.outputs[0].logprobs):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
