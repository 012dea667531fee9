"""The GGUF-built tokenizer and chat template agree with HF's reading of the same file."""

from __future__ import annotations

import pytest

from shoal.models.gguf_loader import open_gguf
from shoal.models.loader import bundled_model_path
from shoal.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizers_pair():
    from transformers import AutoTokenizer

    path = bundled_model_path()
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return Tokenizer.from_gguf(open_gguf(path)), hf


TEXTS = [
    "Hello, world! How are you today?",
    "  Leading spaces, tabs\tand\nnew lines.\n\n",
    "naïve café — déjà vu 日本語 🌊",
    "<|im_start|>user\nhi<|im_end|>",  # special tokens stay whole
    "don't won't it's we'll they've I'm",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tokenizers_pair, text):
    ours, hf = tokenizers_pair
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_digits_are_split_one_by_one_like_llama_cpp(tokenizers_pair):
    ours, _ = tokenizers_pair
    ids = ours.encode("2024")
    assert [ours.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_chat_template_matches_hf(tokenizers_pair):
    ours, hf = tokenizers_pair
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a fish."},
        {"role": "assistant", "content": "Salmon."},
        {"role": "user", "content": "Another?"},
    ]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert ours.eos_token_ids == {hf.convert_tokens_to_ids("<|im_end|>")}
