"""Requests for `shoal bench serve`: synthetic prompts of exact token lengths, or a dataset."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench.synthetic_ids import random_ids
from shoal.models.tokenizer import Tokenizer


@dataclass
class BenchRequest:
    prompt: str  # completions: the prompt; chat: the last user message when `messages` is None
    messages: list[dict[str, Any]] | None
    input_len: int  # prompt tokens by the model's tokenizer (chat: the messages' text, not the template)
    output_len: int


def exact_length_text(tok: Tokenizer, n: int, rng: random.Random) -> str:
    """Random text that the tokenizer encodes to exactly n tokens (round trip checked)."""
    vocab = tok.vocab_size
    ids = random_ids(rng, n, vocab)
    text = tok.decode(ids)
    for _ in range(50):
        again = tok.encode(text, add_special_tokens=False)
        if len(again) == n:
            return text
        # Merges across token boundaries change the count; re-draw the tail and try again.
        ids = again[:n] if len(again) > n else again + random_ids(rng, n - len(again), vocab)
        text = tok.decode(ids)
    raise RuntimeError(f"could not build a prompt of exactly {n} tokens")


def check_length_range(name: str, bounds: tuple[int, int] | None) -> None:
    if bounds is not None and not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"{name} length range {tuple(bounds)}: give MIN and MAX with 1 <= MIN <= MAX")


def request_lengths(
    num: int,
    input_len: int,
    output_len: int,
    seed: int,
    input_range: tuple[int, int] | None = None,
    output_range: tuple[int, int] | None = None,
) -> list[tuple[int, int]]:
    """Each synthetic request's (prompt, output) tokens: the fixed lengths, or drawn uniformly from
    the ranges (both ends in) by a generator of their own, so that a simulator of the same run can
    draw the same lengths without building the prompts."""
    check_length_range("input", input_range)
    check_length_range("output", output_range)
    rng = random.Random(f"lengths-{seed}")
    return [
        (
            rng.randint(*input_range) if input_range else input_len,
            rng.randint(*output_range) if output_range else output_len,
        )
        for _ in range(num)
    ]


def synthetic(
    tok: Tokenizer,
    num: int,
    input_len: int,
    output_len: int,
    seed: int,
    chat: bool,
    input_range: tuple[int, int] | None = None,
    output_range: tuple[int, int] | None = None,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for n_in, n_out in request_lengths(num, input_len, output_len, seed, input_range, output_range):
        text = exact_length_text(tok, n_in, rng)
        messages = [{"role": "user", "content": text}] if chat else None
        out.append(BenchRequest(text, messages, n_in, n_out))
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
