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
    assert engine.num_failed_requests == 2  # the fault fired, after the others had sampled
    for step in (3, 6):
        assert "after sampling" in faulty[f"marked-{step}"].error
    for rid in _survivors(faulty_llm.tokenizer):
        got, want = faulty[rid].outputs[0], clean[rid].outputs[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, rid
        assert faulty[rid].error is None
    assert engine.spec_stats.num_drafts > 0
    engine.step()  # the runner hears of the last finished requests
    assert_pool_whole(engine)
