"""Speculative decoding: proposers guess a request's next tokens, the target model checks them all
in one forward pass (see Sampler.verify), so an accepted guess saves a whole decode step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.engine.sampler import SamplingState


@dataclass
class SpeculativeConfig:
    speculative: str | None = None  # the method: None, "ngram" or "draft"
    num_speculative_tokens: int = 4
    # ngram: the longest and shortest suffix of the context looked up in the context itself. A
    # one-token match guesses too often to pay for its verify rows: on the rewrite workload of
    # benchmarks/speculative.py (Zen 3, int4, c=1) n_min 1 accepted 53% of guesses, n_min 2 71%,
    # and ran 6% faster.
    ngram_max: int = 4
    ngram_min: int = 2
    # draft: the draft model's checkpoint (None: the target's own) and how its weights run
    speculative_model: str | None = None
    speculative_quantization: str | None = "int4"
    # No proposals while more requests than this sample in a step: a large batch already reads
    # each weight once for many tokens, so verify rows add work without saving reads. None: the
    # method's default (draft: 4, where on the 2-core Zen 3 here c=8 ran 0.7-0.9x; ngram: no limit,
    # 1.2x at c=8 on the rewrite workload).
    speculative_disable_by_batch_size: int | None = None

    @property
    def max_batch(self) -> int | None:
        if self.speculative_disable_by_batch_size is not None:
            return self.speculative_disable_by_batch_size
        return 4 if self.speculative == "draft" else None

    def check(self) -> None:
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"unknown speculative method {self.speculative!r}; choose ngram or draft")
        if self.speculative is not None and self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")


class Proposer:
    """Guesses the tokens after each request's context; an empty guess means decode as usual.
    Runs in the runner, after the step's sampling, for the requests that sampled."""

    def propose(self, requests: dict[str, SamplingState]) -> dict[str, list[int]]:
        raise NotImplementedError

    def drop(self, request_id: str) -> None:
        """The request finished or was preempted: forget what was kept for it."""


@dataclass
class NgramProposer(Proposer):
    """Prompt lookup: the continuation of the latest earlier occurrence of the context's last n
    tokens (longest n first). Free to compute, and right wherever the output repeats its input:
    rewriting, summarising, code edits, extraction."""

    k: int
    n_max: int = 4
    n_min: int = 2

    def propose(self, requests: dict[str, SamplingState]) -> dict[str, list[int]]:
        out = {}
        for rid, state in requests.items():
            if state.matcher is not None:
                continue  # a grammar's mask at each proposed position is not computed: decode as usual
            guess = ngram_lookup(
                state.prompt_token_ids + state.output_token_ids, self.k, self.n_max, self.n_min
            )
            if guess:
                out[rid] = guess
        return out


def ngram_lookup(context: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's last n tokens,
    for the largest n in [n_min, n_max] that occurs."""
    size = len(context)
    if size < n_min + 1:
        return []
    ids = torch.tensor(context)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # Windows that start early enough to have a token after them.
        windows = ids[: size - 1].unfold(0, n, 1)
        hits = (windows == ids[size - n :]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return context[start : start + k]
    return []


@dataclass
class SpecDecodeStats:
    """Counters since start: verify passes, tokens proposed, tokens accepted (in all and at
    each proposal position: position j counts when the first j+1 guesses were all right)."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] | None = None

    def __post_init__(self):
        if self.accepted_per_position is None:
            self.accepted_per_position = [0] * max(self.k, 0)

    def observe(self, results: dict[str, tuple[int, int]]) -> None:
        for proposed, accepted in results.values():
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            for j in range(min(accepted, len(self.accepted_per_position))):
                self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.k,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )
