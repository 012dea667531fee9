"""Random token ids for synthetic prompts: clear of the special tokens at the start of most
vocabularies, and drawn afresh, so no two prompts share a cached prefix."""

from __future__ import annotations

import random

FIRST_PLAIN_ID = 1000
# Ids below FIRST_PLAIN_ID + this exist in every vocabulary served here (SmolLM2's has 49,152).
PLAIN_SPAN = 40_000


def random_ids(rng: random.Random, n: int, vocab: int | None = None) -> list[int]:
    """n ids from [FIRST_PLAIN_ID, vocab), or from the span every vocabulary here has."""
    top = FIRST_PLAIN_ID + PLAIN_SPAN if vocab is None else vocab
    return [rng.randrange(FIRST_PLAIN_ID, top) for _ in range(n)]
