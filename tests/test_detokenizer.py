"""Incremental detokenization on the bundled tokenizer: multi-byte text, stop strings."""

from __future__ import annotations

import pytest

from shoal.engine.detokenizer import IncrementalDetokenizer
from shoal.models.gguf_loader import open_gguf
from shoal.models.loader import bundled_model_path
from shoal.models.tokenizer import Tokenizer

TEXTS = [
    "Plain English text, with punctuation!",
    "naïve café — déjà vu 日本語のテキスト 🌊🐟 emoji 👩‍👩‍👧",
    "  leading spaces and\nnew lines\n\n\ttabs",
    "def f(x):\n    return x ** 2  # ünïcödé",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(open_gguf(bundled_model_path()))


def stream(tok, prompt, text, stop=(), include=False):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode(prompt), list(stop), include)
    deltas = []
    hit = None
    for i, t in enumerate(ids):
        hit = d.add_token(t)
        deltas.append(d.take_delta(finished=hit is not None or i == len(ids) - 1))
        if hit:
            break
    return deltas, hit, ids


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_full_decode_and_never_split_a_character(tok, text):
    deltas, _, ids = stream(tok, "Say:", text)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    multibyte_tokens = [t for t in ids if "\ufffd" in tok.decode([t])]
    if "🌊" in text:
        assert multibyte_tokens  # the test really covers characters split across tokens


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(tok):
    text = "The answer is forty two. Then more text follows here."
    deltas, hit, _ = stream(tok, "Q:", text, stop=["forty two"])
    assert hit == "forty two"
    assert "".join(deltas) == "The answer is "
    assert not any("forty" in d for d in deltas)


def test_stop_string_can_be_included(tok):
    deltas, hit, _ = stream(tok, "Q:", "alpha beta gamma delta", stop=["gamma"], include=True)
    assert hit == "gamma"
    assert "".join(deltas) == "alpha beta gamma"


def test_stop_string_inside_a_multibyte_run(tok):
    deltas, hit, _ = stream(tok, "Q:", "fish 🐟 and waves 🌊 end", stop=["🌊"])
    assert hit == "🌊"
    assert "".join(deltas) == "fish 🐟 and waves "


def test_prefix_matcher_finds_the_longest_partial_stop():
    """The KMP tracker against the obvious quadratic search, on random streams."""
    import random

    from shoal.engine.detokenizer import PrefixMatcher

    def longest(text: str, stop: str) -> int:
        return next((k for k in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:k])), 0)

    rng = random.Random(0)
    for _ in range(2000):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 8)))
        m, text = PrefixMatcher(stop), ""
        for _ in range(rng.randint(1, 6)):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            text += piece
            m.feed(piece)
            assert m.state == longest(text, stop), (stop, text)


def test_stop_strings_wait_for_min_tokens(tok):
    text = "one two one two one two one two"
    ids = tok.encode(text)
    first_two = next(i for i in range(len(ids)) if "two" in tok.decode(ids[: i + 1]))
    for min_tokens, stops_after in ((0, first_two + 1), (first_two + 3, None)):
        d = IncrementalDetokenizer(tok, tok.encode("Count:"), ["two"], min_tokens=min_tokens)
        hit_at = next((i + 1 for i, t in enumerate(ids) if d.add_token(t)), None)
        if stops_after is not None:
            assert hit_at == stops_after
        else:  # the first "two" came too early to count; a later one stops it
            assert hit_at is not None and hit_at >= min_tokens
