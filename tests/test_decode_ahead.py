"""Decoding ahead (engine.decode_ahead): each greedy decode step's successor is queued before its
tokens are read, and used when the scheduler asks for exactly that step. On the CPU the queued
step runs at once, so these check what it does to tokens and the pool, not its timing: an engine
deciding ahead must give every request the tokens, log-probabilities and finish it gets without."""

from __future__ import annotations

import random

import pytest

from shoal import SamplingParams
from shoal.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from shoal.engine.llm_engine import LLMEngine
from tests.helpers import assert_pool_whole


def _engine(bundled, ahead: str, num_blocks: int, **scheduler) -> LLMEngine:
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=num_blocks), scheduler=SchedulerConfig(**scheduler), decode_ahead=ahead
    )
    engine = LLMEngine(cfg, loaded=bundled)
    runner = engine.core.executor.runner
    if runner.fused_decoder is None:
        pytest.skip("no fused CPU decode layer here (its C kernels): decode steps take no fast path")
    # Every decode step on the fast path, whatever this CPU's measured crossover.
    runner.fused_decoder.max_rows = None
    return engine


def _scrape(engine: LLMEngine) -> str:
    """The engine's counters as a replica's /metrics renders them."""
    from prometheus_client import CollectorRegistry, generate_latest

    from shoal.server.metrics import _EngineCollector

    registry = CollectorRegistry()
    registry.register(_EngineCollector("m", engine.stats))
    return generate_latest(registry).decode()


def _run(engine: LLMEngine, arrivals: dict[int, list], aborts: dict[int, str]) -> dict:
    done, step = {}, 0
    while step == 0 or engine.has_unfinished_requests() or any(s > step for s in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        if step in aborts:
            engine.abort_request(aborts[step])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return done


def test_deciding_ahead_changes_no_token_through_preemption_arrivals_and_aborts(bundled):
    """Greedy rows of different lengths (one stopping on a stop token, one aborted), rows
    that ask for logprobs or sample (their steps are not decided ahead), late arrivals, and a pool
    small enough to preempt: the same outputs with and without deciding ahead, queued steps both
    used and dropped, and every block back in the pool."""
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (9, 30, 17, 44, 5, 21, 12)]
    greedy = dict(temperature=0, ignore_eos=True)
    # c stops on a token of its own output, which no step can foresee: the step queued then is
    # dropped. (Its tokens alone are its tokens in a batch: the fast path is batch invariant.)
    probe = _engine(bundled, "off", 64)
    probe.add_request("c", prompts[2], SamplingParams(max_tokens=40, **greedy))
    alone = _run(probe, {}, {})["c"].outputs[0].token_ids
    stop = next(t for i, t in enumerate(alone) if i >= 25 and t not in alone[:i])
    arrivals = {
        0: [
            ("a", prompts[0], SamplingParams(max_tokens=40, **greedy)),
            ("b", prompts[1], SamplingParams(max_tokens=30, **greedy)),
            ("c", prompts[2], SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[stop])),
        ],
        40: [("d", prompts[3], SamplingParams(max_tokens=30, logprobs=2, **greedy))],
        44: [
            ("e", prompts[4], SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)),
            ("gone", prompts[5], SamplingParams(max_tokens=40, **greedy)),
        ],
        60: [("f", prompts[6], SamplingParams(max_tokens=35, **greedy))],
    }
    runs = {}
    for ahead in ("off", "on"):
        engine = _engine(bundled, ahead, 9, max_num_seqs=4, max_num_batched_tokens=32)
        runs[ahead] = _run(engine, arrivals, {52: "gone"})
        assert_pool_whole(engine)
        runner = engine.core.executor.runner
        if ahead == "on":
            stats = engine.stats()
            assert stats.num_preemptions > 0  # the pool really was short
            taken, dropped = stats.steps_from_queue, stats.queued_steps_dropped
            assert taken > 10 and dropped > 0
            scraped = _scrape(engine)
            assert f'shoal:engine_steps_decided_ahead_total{{model_name="m"}} {taken}.0' in scraped
            assert f'shoal:engine_steps_decided_ahead_dropped_total{{model_name="m"}} {dropped}.0' in scraped
        else:
            assert runner.ahead is None
    assert sorted(runs["on"]) == sorted(runs["off"]) == ["a", "b", "c", "d", "e", "f"]
    for rid, want in runs["off"].items():
        got = runs["on"][rid].outputs[0]
        assert got.token_ids == want.outputs[0].token_ids, rid
        assert got.finish_reason == want.outputs[0].finish_reason, rid
        for x, y in zip(got.logprobs or [], want.outputs[0].logprobs or []):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4


def test_a_steady_greedy_batch_runs_nearly_every_step_from_the_queue(bundled):
    """Rows that only decode: every step but those that open a new block (the scheduler adds it
    with the step) or end a request is the one queued the step before."""
    prompts = [[1000 + 7 * i + j for j in range(20 + i)] for i in range(3)]
    engine = _engine(bundled, "on", 64, max_num_seqs=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    stats = engine.stats()
    taken, dropped = stats.steps_from_queue, stats.queued_steps_dropped
    decode_steps = steps - 1  # the first step runs the prompts
    # 47 decode steps: at most 3 open a block for some row (3 rows, 16-token blocks, one of the three
    # each time), and the last one queues nothing.
    assert taken >= decode_steps - 1 - 3 * 3, (taken, dropped, decode_steps)
    assert dropped == 0
