"""Sampler behaviour on real logit tensors: filters, penalties, min_tokens, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.sampler import Sampler, SamplingState, greedy_tokens
from shoal.engine.sampling_params import InvalidParamError, SamplingParams

VOCAB = 50
EOS = 3


def state(seed=0, prompt=(1, 2), outputs=(), **params):
    return SamplingState(SamplingParams(**params), seed, list(prompt), list(outputs))


def draws(logits, n=300, **params):
    """Tokens drawn at n successive positions (each position has its own draw)."""
    sampler = Sampler(frozenset({EOS}), VOCAB)
    s = state(**params)
    found = set()
    for _ in range(n):
        token = sampler(logits.unsqueeze(0), [s])[0]
        s.output_token_ids.append(token)
        found.add(token)
    return found


LOGITS = torch.linspace(0, 4, VOCAB)  # token 49 is the most likely, then 48, ...


def test_greedy_takes_the_argmax():
    assert draws(LOGITS, n=5, temperature=0) == {49}


def test_top_k_limits_to_k_best():
    assert draws(LOGITS, top_k=3) == {47, 48, 49}


def test_top_p_keeps_the_smallest_nucleus():
    probs = LOGITS.softmax(-1)
    ordered = probs.sort(descending=True)
    need = int((ordered.values.cumsum(0) < 0.5).sum()) + 1  # tokens needed to reach 50 % mass
    got = draws(LOGITS, top_p=0.5, n=600)
    assert got <= set(ordered.indices[:need].tolist())
    assert len(got) > 1


def test_min_p_drops_unlikely_tokens():
    probs = LOGITS.softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    assert draws(LOGITS, min_p=0.5, n=600) <= allowed


def test_same_seed_same_tokens_different_seed_differs():
    sampler = Sampler(frozenset({EOS}), VOCAB)
    a, b, c = state(seed=5), state(seed=5), state(seed=6)
    flat = torch.zeros(1, VOCAB)

    def run(s, batch_with=None):
        seq = []
        for _ in range(20):
            states = [s] if batch_with is None else [s, batch_with]
            token = sampler(flat.repeat(len(states), 1), states)[0]
            s.output_token_ids.append(token)
            seq.append(token)
        return seq

    seq_a = run(a)
    assert run(b, batch_with=state(seed=99)) == seq_a  # batched with another
    assert run(c) != seq_a
    assert len(set(seq_a)) > 5  # each position draws anew


def test_a_draw_depends_on_seed_and_position_only():
    """A stream resumed elsewhere, or a step retried, draws what the original would have."""
    sampler = Sampler(frozenset({EOS}), VOCAB)
    flat = torch.zeros(1, VOCAB)
    fresh = state(seed=7, outputs=[1, 2, 3], temperature=1.0)
    again = state(seed=7, outputs=[1, 2, 3], temperature=1.0)
    first = sampler(flat, [fresh])[0]
    assert sampler(flat, [fresh])[0] == first  # nothing appended: the same position draws the same
    assert sampler(flat, [again])[0] == first


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(VOCAB)
    logits[EOS] = 100.0
    logits[7] = 99.0
    sampler = Sampler(frozenset({EOS}), VOCAB)
    early = state(temperature=0, min_tokens=2, stop_token_ids=[7], outputs=[10])
    assert sampler(logits.unsqueeze(0), [early])[0] not in (EOS, 7)
    reached = state(temperature=0, min_tokens=2, stop_token_ids=[7], outputs=[10, 11])
    assert sampler(logits.unsqueeze(0), [reached])[0] == EOS


def test_repetition_penalty_follows_hf_convention():
    logits = torch.zeros(VOCAB)
    logits[10], logits[11], logits[12] = 2.0, -2.0, 1.9
    sampler = Sampler(frozenset(), VOCAB)
    # Token 10 appeared (prompt): 2.0 / 2 = 1.0 < 1.9, so 12 wins.
    s = state(prompt=(10, 11), temperature=0, repetition_penalty=2.0)
    assert sampler(logits.unsqueeze(0), [s])[0] == 12


def test_frequency_and_presence_penalties_count_outputs():
    logits = torch.zeros(VOCAB)
    logits[20], logits[21] = 3.0, 2.0
    sampler = Sampler(frozenset(), VOCAB)
    # 20 was generated twice: 3.0 - 2 * 0.4 - 0.5 = 1.7 < 2.0
    s = state(outputs=[20, 20], temperature=0, frequency_penalty=0.4, presence_penalty=0.5)
    assert sampler(logits.unsqueeze(0), [s])[0] == 21


def test_logprobs_are_raw_model_logprobs_with_rank():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    states = [state(temperature=0, logprobs=3), state(temperature=0)]
    tokens = Sampler(frozenset(), VOCAB)(logits, states)
    lps = Sampler.logprobs(logits, tokens, states)
    ref = torch.log_softmax(logits[0], -1)
    assert lps[1] is None
    assert lps[0].token_id == tokens[0] and lps[0].rank == 1
    assert lps[0].logprob == pytest.approx(float(ref.max()), abs=1e-6)
    assert [t for t, _ in lps[0].top] == ref.topk(3).indices.tolist()


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=-0.1), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(stop_token_ids=list(range(5000))), "stop_token_ids"),
        (dict(stop=["x" * 5000]), "stop"),
        (dict(logit_bias={3: 101.0}), "logit_bias"),
        (dict(logprobs=21), "logprobs"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(presence_penalty=3), "presence_penalty"),
    ],
)
def test_bad_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_extreme_values_sample_sanely():
    """Values at the edge of their range give the answer they mean, not NaN garbage."""
    logits = torch.linspace(0, 4, VOCAB)
    assert draws(logits, n=20, temperature=1e-300) == {49}  # as good as greedy
    assert draws(logits, n=20, top_p=1e-300) == {49}  # the nucleus keeps its first token
    assert draws(logits, n=20, top_p=0.0) == {49}
    assert draws(logits, n=20, top_k=10**20) != {49}  # a k past the vocabulary is no limit


def test_logit_bias_and_allowed_tokens_steer_the_draw():
    logits = torch.linspace(0, 4, VOCAB)
    assert draws(logits, n=10, temperature=0, logit_bias={5: 100.0}) == {5}
    assert draws(logits, n=10, temperature=0, logit_bias={49: -100.0}) == {48}
    assert draws(logits, n=200, allowed_token_ids=[1, 2]) == {1, 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_argmax_with_ties_and_nans(dtype):
    """The greedy fast path picks what argmax picks: the first of tied maxima, a NaN as highest."""
    torch.manual_seed(0)
    logits = torch.randint(0, 4, (32, 1000)).to(dtype)  # few values: many ties in every row
    logits[3, 17] = logits[3, 900] = float("nan")
    logits[5] = 1.0  # a row of nothing but ties
    logits[7, 0] = float("-inf")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[3] == 17 and greedy_tokens(logits)[5] == 0
