"""Requests for `shoal bench serve`: synthetic prompts of exact token lengths, or a dataset."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.models.tokenizer import Tokenizer

# Ids well clear of the special tokens at the start of most vocabularies.
FIRST_PLAIN_ID = 1000


@dataclass
class BenchRequest:
    prompt: str  # completions: the prompt; chat: the last user message when `messages` is None
    messages: list[dict[str, Any]] | None
    input_len: int  # prompt tokens by the model's tokenizer (chat: the messages' text, not the template)
    output_len: int


def exact_length_text(tok: Tokenizer, n: int, rng: random.Random) -> str:
    """Random text that the tokenizer encodes to exactly n tokens (round trip checked)."""
    vocab = tok.vocab_size
    ids = [rng.randrange(FIRST_PLAIN_ID, vocab) for _ in range(n)]
    text = tok.decode(ids)
    for _ in range(50):
        again = tok.encode(text, add_special_tokens=False)
        if len(again) == n:
            return text
        # Merges across token boundaries change the count; re-draw the tail and try again.
        ids = (
            again[:n]
            if len(again) > n
            else again + [rng.randrange(FIRST_PLAIN_ID, vocab) for _ in range(n - len(again))]
        )
        text = tok.decode(ids)
    raise RuntimeError(f"could not build a prompt of exactly {n} tokens")


def synthetic(
    tok: Tokenizer, num: int, input_len: int, output_len: int, seed: int, chat: bool
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        text = exact_length_text(tok, input_len, rng)
        messages = [{"role": "user", "content": text}] if chat else None
        out.append(BenchRequest(text, messages, input_len, output_len))
    return out


def _normalise(turns: list[dict]) -> list[dict[str, Any]]:
    roles = {
        "human": "user",
        "user": "user",
        "gpt": "assistant",
        "assistant": "assistant",
        "system": "system",
    }
    msgs = []
    for t in turns:
        role = roles.get(t.get("role") or t.get("from"), "user")
        msgs.append({"role": role, "content": t.get("content", t.get("value", ""))})
    return msgs


def from_dataset(
    path: str, tok: Tokenizer, num: int, output_len: int, seed: int, chat: bool
) -> list[BenchRequest]:
    """JSON list or JSONL of {"messages": [...]}, ShareGPT {"conversations": [...]}, or {"prompt": "..."}."""
    text = Path(path).read_text()
    records = (
        json.loads(text)
        if text.lstrip().startswith("[")
        else [json.loads(l) for l in text.splitlines() if l.strip()]
    )
    rng = random.Random(seed)
    rng.shuffle(records)
    out = []
    for rec in records:
        if "prompt" in rec:
            messages = [{"role": "user", "content": rec["prompt"]}]
        else:
            messages = _normalise(rec.get("messages") or rec.get("conversations") or [])
        # Up to and including the last user turn: that is what a client would send.
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            continue
        messages = messages[: last_user + 1]
        prompt = messages[-1]["content"]
        n_in = sum(len(tok.encode(m["content"], add_special_tokens=False)) for m in messages)
        n_out = int(rec.get("max_tokens", output_len))
        out.append(BenchRequest(prompt, messages if chat else None, n_in, n_out))
        if len(out) == num:
            break
    if not out:
        raise ValueError(f"{path} holds no usable conversations")
    return out
