"""Turns per-step token results into RequestOutputs: text, logprobs, finish reasons, n choices."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine.detokenizer import IncrementalDetokenizer
from shoal.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from shoal.engine.request import Request
from shoal.models.tokenizer import Tokenizer


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    detokenizers: list[IncrementalDetokenizer]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [0] is always None: nothing predicts it
    metrics: dict[str, float] = field(default_factory=dict)
    num_seen: list[int] = field(default_factory=list)  # output tokens of each choice already processed
    error: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}

    def add(self, req: Request, prompt: str | None, prior_text_sent: int | None = None) -> None:
        """A resumed request's prior output is decoded, not emitted, except for the text past
        `prior_text_sent` characters that its client has not received yet."""
        p = req.params
        group = self.groups[req.group_id] = _Group(
            req.group_id,
            prompt,
            req.prompt_token_ids,
            [CompletionOutput(i, logprobs=[] if p.logprobs is not None else None) for i in range(p.n)],
            [
                IncrementalDetokenizer(
                    self.tokenizer,
                    req.prompt_token_ids,
                    p.stop,
                    p.include_stop_str_in_output,
                    p.skip_special_tokens,
                )
                for _ in range(p.n)
            ],
            prompt_logprobs=[None] * len(req.prompt_token_ids) if p.prompt_logprobs is not None else None,
            num_seen=[req.num_output_tokens] * p.n,
        )
        prior = req.output_token_ids
        if prior:
            detok = group.detokenizers[0]
            for token in prior:
                detok.add_token(token)
            detok.emitted = min(prior_text_sent or 0, len(detok.text))
            group.outputs[0].token_ids = prior

    def add_prompt_logprobs(self, found: dict[str, tuple[int, list[TokenLogprob]]]) -> None:
        for rid, (start, lps) in found.items():
            group = self.groups.get(rid)
            if group is not None and group.prompt_logprobs is not None:
                group.prompt_logprobs[start : start + len(lps)] = lps

    def drop(self, group_id: str) -> None:
        self.groups.pop(group_id, None)

    def process(
        self, changed: list[Request], logprobs: dict[str, list[TokenLogprob]], on_stop_string
    ) -> list[RequestOutput]:
        """`on_stop_string(req, stop)` finishes a request whose text hit a stop string; tokens
        after the one that completed it are dropped."""
        touched: dict[str, _Group] = {}
        for req in changed:
            group = self.groups.get(req.group_id)
            if group is None:
                continue
            if group.request_id not in touched:
                touched[group.request_id] = group
                for o in group.outputs:
                    o.delta_text, o.delta_token_ids, o.delta_logprobs = "", [], []
            if req.index == 0 and req.num_cached_tokens > 0:
                group.num_cached_tokens = req.num_cached_tokens
            if not group.metrics and req.first_scheduled_time is not None:
                group.metrics = {
                    "arrival_time": req.arrival_time,
                    "first_scheduled_time": req.first_scheduled_time,
                }
            comp = group.outputs[req.index]
            detok = group.detokenizers[req.index]
            seen = group.num_seen[req.index]
            new_tokens = req.output_token_ids[seen:]
            for i, token in enumerate(new_tokens):
                stop = detok.add_token(token)
                if stop is not None:
                    if not req.is_finished:
                        on_stop_string(req, stop)
                    new_tokens = new_tokens[: i + 1]
                    del req.token_ids[req.num_prompt_tokens + seen + i + 1 :]
                    break
            group.num_seen[req.index] += len(new_tokens)
            comp.token_ids = req.output_token_ids
            comp.delta_token_ids = new_tokens
            lps = logprobs.get(req.request_id, [])[: len(new_tokens)] if new_tokens else []
            comp.delta_logprobs = lps
            if comp.logprobs is not None:
                comp.logprobs.extend(lps)
            if req.error is not None:
                group.error = req.error
            if req.is_finished:
                comp.finish_reason = req.status.value
                comp.stop_reason = req.stop_reason
            comp.delta_text = detok.take_delta(req.is_finished)
            comp.text = detok.text[: detok.emitted]
        results = []
        for gid, group in touched.items():
            # One failed choice fails the request: its siblings are dropped, not waited for.
            finished = group.error is not None or all(o.finished for o in group.outputs)
            results.append(
                RequestOutput(
                    gid,
                    group.prompt,
                    group.prompt_token_ids,
                    group.outputs,
                    finished=finished,
                    num_cached_tokens=group.num_cached_tokens,
                    prompt_logprobs=group.prompt_logprobs,
                    metrics=dict(group.metrics),
                    error=group.error,
                )
            )
            if finished:
                del self.groups[gid]
        return results
