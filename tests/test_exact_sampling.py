"""Seeded sampling is exact: a step that fails after sampling and runs again request by request
leaves every other request's tokens as a fault-free run gives them (penalties, grammar, proposals
and all), and with speculation a seeded request's tokens depend on nothing but its seed and its
context: not on the batch, not on whether it was resumed elsewhere, not on speculation itself."""

from __future__ import annotations

import json

import pytest

from shoal import LLM, SamplingParams
from shoal.engine.structured import StructuredOutput
from tests.helpers import PROMPTS, assert_pool_whole, run_to_completion

REPEAT = (
    "Rewrite this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank. "
    "Rewrite: The quick brown fox jumps over the lazy dog near the river bank. Rewrite:"
)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
MARKER = "ZZFAILAFTERSAMPLINGZZ"


def _survivors(tok) -> dict[str, tuple[list[int], SamplingParams]]:
    """Requests that must come out of a failed step untouched, one for each piece of runner state."""
    person = tok.encode_chat([{"role": "user", "content": "Invent a person. Answer in JSON."}])
    return {
        "penalised": (
            tok.encode(PROMPTS[1]),
            SamplingParams(
                temperature=0.8,
                seed=5,
                max_tokens=24,
                ignore_eos=True,
                frequency_penalty=0.4,
                presence_penalty=0.3,
                repetition_penalty=1.2,
            ),
        ),
        "grammar": (
            person,
            SamplingParams(
                temperature=0.8,
                seed=6,
                max_tokens=40,
                structured=StructuredOutput("json_schema", json.dumps(SCHEMA)),
            ),
        ),
        "proposed": (
            tok.encode(REPEAT),
            SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
        ),
    }


def _run_with_late_arrivals(llm: LLM) -> dict:
    """The survivors decode; two marked requests arrive while they do (at steps 3 and 6)."""
    engine = llm.engine
    for rid, (ids, params) in _survivors(llm.tokenizer).items():
        engine.add_request(rid, ids, params)
    done = {}
    for step in range(8):
        if step in (3, 6):
            engine.add_request(f"marked-{step}", f"{MARKER} {PROMPTS[3]}", SamplingParams(max_tokens=4))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    done.update(run_to_completion(engine))
    return done


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_step_that_fails_after_sampling_runs_again_exactly(bundled, monkeypatch, method):
    spec = dict(speculative=method, num_speculative_tokens=3, speculative_disable_by_batch_size=8)
    clean = _run_with_late_arrivals(LLM(loaded=bundled, num_blocks=256, **spec))
    monkeypatch.setenv("SHOAL_FAULT_SAMPLED_ERROR_ON", MARKER)
    faulty_llm = LLM(loaded=bundled, num_blocks=256, **spec)
    faulty = _run_with_late_arrivals(faulty_llm)
    engine = faulty_llm.engine
    assert engine.core.num_failed_requests == 2  # the fault fired, after the others had sampled
    for step in (3, 6):
        assert "after sampling" in faulty[f"marked-{step}"].error
    for rid in _survivors(faulty_llm.tokenizer):
        got, want = faulty[rid].outputs[0], clean[rid].outputs[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, rid
        assert faulty[rid].error is None
    assert engine.core.spec_stats.num_drafts > 0
    engine.step()  # the runner hears of the last finished requests
    assert_pool_whole(engine)


def test_seeded_speculation_draws_as_alone_as_resumed_and_as_without_proposals(bundled):
    """Temperature 0.8, ngram proposals: the request alone; among requests of other lengths in a
    64-token budget (proposals cut by the budget, and off while more than 2 requests sample);
    resumed from its first k tokens the way the gateway resumes a stream; and with speculation off."""
    params = SamplingParams(temperature=0.8, seed=21, max_tokens=32, ignore_eos=True)
    spec = dict(speculative="ngram", num_speculative_tokens=4, speculative_disable_by_batch_size=2)
    alone = LLM(loaded=bundled, num_blocks=256, **spec)
    want = alone.generate(REPEAT, params)[0].outputs[0].token_ids
    assert alone.engine.core.spec_stats.num_accepted_tokens > 0  # verify passes decided tokens

    crowded = LLM(loaded=bundled, num_blocks=256, max_num_batched_tokens=64, **spec)
    engine = crowded.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"other-{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=8 + 3 * i))
    engine.add_request("x", REPEAT, params)
    assert run_to_completion(engine)["x"].outputs[0].token_ids == want

    for k in (5, 14):
        engine.add_request(f"resumed-{k}", REPEAT, params, prior_output_ids=want[:k])
        engine.add_request(f"beside-{k}", PROMPTS[6], SamplingParams(temperature=1.0, max_tokens=12))
        resumed = run_to_completion(engine)[f"resumed-{k}"].outputs[0]
        assert resumed.token_ids == want  # the prior tokens, then the rest as the original drew it
    assert_pool_whole(engine)

    # Exactly the tokens of plain decoding, not only the same distribution.
    plain = LLM(loaded=bundled, num_blocks=256)
    assert plain.generate(REPEAT, params)[0].outputs[0].token_ids == want
