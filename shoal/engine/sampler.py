"""Turns logits into tokens, row by row with each request's own options and RNG.

A request's draw for the token at position p comes from a generator seeded with (its seed, p), so
a seeded request draws the same tokens whatever else shares the batch, after a preemption, after
a failed step is retried, and when another replica resumes it from its streamed tokens.
"""

from __future__ import annotations

from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.engine.outputs import TokenLogprob
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.seeded_draws import exponential_race, position_generator
from shoal.engine.structured import GrammarBackend


@dataclass
class SamplingState:
    """Runner-side state of one request."""

    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator = field(default_factory=torch.Generator)
    matcher: Any = None  # the grammar's state, for a request with structured output
    next_mask: Any = None  # its next token mask, being computed while the forward pass runs
    # Greedy with nothing that shapes the logits: its token is the argmax (the batch's fast path).
    plain_greedy: bool = field(init=False)
    # For penalties, kept up to date from the first step that needs them (not rebuilt each step
    # from the whole output): how often each token id was output, and the prompt's token ids.
    _counts: torch.Tensor | None = field(default=None, init=False, repr=False)
    _counted: int = field(default=0, init=False, repr=False)  # output tokens in _counts
    _prompt_seen: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = p.greedy and not p.shapes_logits and p.min_tokens == 0

    def output_counts(self, vocab: int) -> torch.Tensor:
        """[vocab] float: occurrences of each token id in the output so far (counting only the
        tokens added since the last ask)."""
        out = self.output_token_ids
        if self._counts is None or self._counts.numel() != vocab or self._counted > len(out):
            self._counts, self._counted = torch.zeros(vocab), 0
        if self._counted < len(out):
            ids = torch.tensor([t for t in out[self._counted :] if t < vocab], dtype=torch.long)
            self._counts.index_add_(0, ids, torch.ones(len(ids)))
            self._counted = len(out)
        return self._counts

    def prompt_seen(self, vocab: int) -> torch.Tensor:
        """[vocab] bool: the token ids in the prompt."""
        if self._prompt_seen is None or self._prompt_seen.numel() != vocab:
            ids = torch.tensor(self.prompt_token_ids, dtype=torch.long)
            self._prompt_seen = torch.zeros(vocab, dtype=torch.bool)
            self._prompt_seen[ids[ids < vocab]] = True
        return self._prompt_seen

    def generator_for_next(self) -> torch.Generator:
        position = len(self.prompt_token_ids) + len(self.output_token_ids)
        return position_generator(self.seed, position, self.generator)

    def follow(self, start_pos: int, token_ids: list[int]) -> None:
        """Takes the scheduler's word for the context: it ends with `token_ids` at `start_pos`.
        Output that an attempt of this step already added (a step that failed after sampling and
        now runs again) is rolled back, grammar included, so that the retry samples from the state
        the scheduler has, not from one a token or more ahead."""
        prompt = len(self.prompt_token_ids)
        lo = max(start_pos - prompt, 0)  # the first output index the fed tokens cover
        fed = token_ids[max(prompt - start_pos, 0) :]
        out = self.output_token_ids
        if lo > len(out):
            raise RuntimeError(f"the runner lost output: it has {len(out)} tokens, the step starts at {lo}")
        keep = lo
        while keep - lo < len(fed) and keep < len(out) and out[keep] == fed[keep - lo]:
            keep += 1
        if keep == len(out) == lo + len(fed):
            return  # the usual case: nothing was added since the scheduler last heard
        self._rewind(keep)
        self._extend(fed[keep - lo :])

    def advance(self, tokens: list[int]) -> None:
        """Appends tokens the step sampled (the scheduler will feed them back in the next step)."""
        self._extend(tokens)

    def _extend(self, tokens: list[int]) -> None:
        self.output_token_ids.extend(tokens)
        if self.matcher is not None and tokens:
            self.matcher.consume_tokens(tokens)

    def _rewind(self, num_output: int) -> None:
        drop = len(self.output_token_ids) - num_output
        pending, self.next_mask = self.next_mask, None  # a mask of the state being undone
        if pending is not None and not pending.cancel():
            wait([pending])  # the grammar thread is reading the matcher: let it finish first
        del self.output_token_ids[num_output:]
        self._counts = None  # other tokens may follow as many: count afresh
        if self.matcher is not None and drop and not self.matcher.rollback(drop):
            raise RuntimeError(f"the grammar could not roll back {drop} tokens")

    def ahead(self, tokens: list[int]) -> SamplingState:
        """This state as it will be once `tokens` are output (penalties, min_tokens and the draw
        of each position see them): for sampling positions past proposed tokens."""
        if not tokens:
            return self
        return SamplingState(
            self.params, self.seed, self.prompt_token_ids, self.output_token_ids + tokens, self.generator
        )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's highest logit, the first of any ties, as `argmax` gives it. On CPU `max`'s
    indices are the same (first of ties, a NaN counts as highest) and 2.5x faster: argmax over a
    batch of 32 vocabulary rows was 5 % of a decode step of the bundled model."""
    return logits.max(dim=-1).indices if logits.device.type == "cpu" else logits.argmax(dim=-1)


class Sampler:
    def __init__(
        self, eos_token_ids: frozenset[int], vocab_size: int, grammars: GrammarBackend | None = None
    ):
        self.eos_token_ids = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self.grammars = grammars

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
        logits = logits.float()
        if all(s.plain_greedy for s in states):
            return greedy_tokens(logits).tolist()
        # Shaping and drawing run on the host: the per-position generators are CPU generators, so
        # a seed means the same draw whichever device computed the logits.
        logits = logits.clone() if logits.device.type == "cpu" else logits.cpu()
        self._mask_early_stop(logits, states)
        self._apply_penalties(logits, states)
        self._apply_bias(logits, states)
        self._apply_grammars(logits, states)
        tokens = greedy_tokens(logits)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            probs = self._filtered_probs(logits[rows], [states[i].params for i in random_rows])
            for j, i in enumerate(random_rows):
                tokens[i] = exponential_race(probs[j], states[i].generator_for_next())
        return tokens.tolist()

    def verify(self, logits: torch.Tensor, state: SamplingState, drafts: list[int]) -> list[int]:
        """Checks proposed tokens against the model: `logits` has a row for each draft position and
        one past them. Returns the accepted drafts and one token of the model's own after them.

        Every row is sampled as plain decoding samples it (same shaping, the same seeded noise
        for its position), and a draft is kept while it equals the token its row picked. This is
        rejection sampling for a proposer that gives its guess probability 1, coupled to the plain
        draw: a guess d is kept with probability p(d), a rejected one is replaced by a token drawn
        from p without d, so the tokens follow p exactly, and they are the very tokens decoding
        without proposals gives for the same seed, in whatever batch the rows were computed.
        """
        k = len(drafts)
        tokens = self(logits, [state.ahead(drafts[:j]) for j in range(k + 1)])
        for j, d in enumerate(drafts):
            if tokens[j] != d:
                return [*drafts[:j], tokens[j]]
        return [*drafts, tokens[k]]

    @staticmethod
    def logprobs(
        logits: torch.Tensor, tokens: list[int], states: list[SamplingState]
    ) -> list[TokenLogprob | None]:
        """Log-probabilities under the model's raw distribution (before penalties and temperature)."""
        out: list[TokenLogprob | None] = [None] * len(states)
        rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if rows:
            found = token_logprobs(
                logits[rows], [tokens[i] for i in rows], [states[i].params.logprobs for i in rows]
            )
            for i, lp in zip(rows, found):
                out[i] = lp
        return out

    def _apply_grammars(self, logits: torch.Tensor, states: list[SamplingState]) -> None:
        rows = [i for i, s in enumerate(states) if s.matcher is not None]
        if not rows:
            return
        masks = []
        for i in rows:
            s = states[i]
            pending, s.next_mask = s.next_mask, None
            masks.append(pending.result() if pending is not None else self.grammars.fill(s.matcher))
        self.grammars.apply(logits, rows, masks)
        for i in rows:
            # Other constraints left no token the grammar allows (min_tokens against a finished
            # JSON value, say): the grammar has the last word, and the output ends.
            if torch.isneginf(logits[i]).all():
                logits[i, self.eos_token_ids] = 0.0

    def _mask_early_stop(self, logits: torch.Tensor, states: list[SamplingState]) -> None:
        for i, s in enumerate(states):
            p = s.params
            if len(s.output_token_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                banned = [t for t in banned if t < logits.shape[1]]
                if banned:
                    logits[i, banned] = float("-inf")

    @staticmethod
    def _apply_bias(logits: torch.Tensor, states: list[SamplingState]) -> None:
        vocab = logits.shape[1]
        for i, s in enumerate(states):
            p = s.params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
                logits[i, ids] += torch.tensor([b for t, b in p.logit_bias.items() if t < vocab])
            if p.allowed_token_ids is not None:
                keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long)
                masked = torch.full((vocab,), float("-inf"))
                masked[keep] = logits[i, keep]
                logits[i] = masked

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> None:
        """Repetition (over prompt and output), then frequency and presence (over the output),
        for every row that has any, in one batch."""
        rows = [i for i, s in enumerate(states) if s.params.has_penalties]
        if not rows:
            return
        vocab = logits.shape[1]
        params = [states[i].params for i in rows]
        counts = torch.stack([states[i].output_counts(vocab) for i in rows])
        shaped = logits[rows]
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = torch.tensor([p.repetition_penalty for p in params], dtype=shaped.dtype).unsqueeze(1)
            seen = torch.stack([states[i].prompt_seen(vocab) for i in rows]) | (counts > 0)
            penalised = torch.where(shaped > 0, shaped / rep, shaped * rep)
            shaped = torch.where(seen, penalised, shaped)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=shaped.dtype).unsqueeze(1)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=shaped.dtype).unsqueeze(1)
        logits[rows] = shaped - (freq * counts + presence * (counts > 0).float())

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        logits = logits / temps
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(tp < 1 for tp in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[1]
            ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k]).unsqueeze(1)
            positions = torch.arange(vocab).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(positions >= ks, float("-inf"))
            probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            before = probs.cumsum(dim=-1) - probs
            cut = before >= torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
            cut[:, 0] = False  # a top_p that rounds to 0 in float32 must still leave one token
            sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs


def token_logprobs(logits: torch.Tensor, targets: list[int], top_n: list[int]) -> list[TokenLogprob]:
    """Each row's log-probability of its target, the target's rank, and the row's top-N."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = max(top_n)
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
    idx = torch.tensor(targets, device=lp.device)
    chosen = lp.gather(1, idx.unsqueeze(1))
    ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
    out = []
    for j, (tok, n) in enumerate(zip(targets, top_n)):
        top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())) if n else []
        out.append(TokenLogprob(tok, float(chosen[j, 0]), ranks[j], top))
    return out
