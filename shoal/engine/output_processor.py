"""The front's half of a step: token deltas from the engine become RequestOutputs with text,
logprobs, finish reasons and n choices. Detokenization and stop strings live here, not on the
engine thread; a stop string found here is handed back to the engine as a command."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine.detokenizer import IncrementalDetokenizer
from shoal.engine.outputs import CompletionOutput, EngineCoreOutput, RequestOutput, TokenLogprob
from shoal.engine.sampling_params import SamplingParams
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
    error: str | None = None
    embedding: list[float] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}

    def add(
        self,
        group_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prior_output_ids: list[int] | None = None,
        prior_text_sent: int | None = None,
    ) -> None:
        """A resumed request's prior output is decoded, not emitted, except for the text past
        `prior_text_sent` characters that its client has not received yet."""
        group = self.groups[group_id] = _Group(
            group_id,
            prompt,
            prompt_token_ids,
            [
                CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)
            ],
            [
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                    params.min_tokens,
                )
                for _ in range(params.n)
            ],
            prompt_logprobs=[None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None,
        )
        if prior_output_ids:
            detok = group.detokenizers[0]
            for token in prior_output_ids:
                detok.add_token(token)
            detok.emitted = min(prior_text_sent or 0, len(detok.text))
            group.outputs[0].token_ids = list(prior_output_ids)

    def drop(self, group_id: str) -> None:
        self.groups.pop(group_id, None)

    def process(
        self, core: list[EngineCoreOutput], now: float | None = None
    ) -> tuple[list[RequestOutput], list]:
        """Applies the engine's deltas (several steps' worth may come at once: a lagging consumer
        gets them merged). Returns one RequestOutput per group touched (its CompletionOutputs are
        the processor's own, changed by the next call) and the (request id, stop string) pairs the
        engine must finish."""
        touched: dict[str, _Group] = {}
        stops = []
        for co in core:
            group = self.groups.get(co.group_id)
            if group is None:
                continue
            if co.prompt_logprobs is not None and group.prompt_logprobs is not None:
                start, lps = co.prompt_logprobs
                group.prompt_logprobs[start : start + len(lps)] = lps
            if co.embedding is not None:
                group.embedding = co.embedding
            if co.index == 0 and co.num_cached_tokens > 0:
                group.num_cached_tokens = co.num_cached_tokens
            if not group.metrics and co.first_scheduled_time is not None:
                group.metrics = {
                    "arrival_time": co.arrival_time,
                    "first_scheduled_time": co.first_scheduled_time,
                }
            if not (co.new_token_ids or co.finish_reason or co.error):
                continue  # a prompt chunk's logprobs: nothing to tell the caller yet
            if co.group_id not in touched:
                touched[co.group_id] = group
                for o in group.outputs:
                    o.delta_text, o.delta_token_ids, o.delta_logprobs = "", [], []
            comp = group.outputs[co.index]
            if comp.finished:
                continue  # finished here by a stop string; the engine had not heard yet
            if co.error is not None:
                group.error = co.error
            detok = group.detokenizers[co.index]
            tokens = co.new_token_ids
            for i, token in enumerate(tokens):
                stop = detok.add_token(token)
                if stop is not None:
                    tokens = tokens[: i + 1]
                    comp.finish_reason, comp.stop_reason = "stop", stop
                    if co.finish_reason is None:
                        stops.append((co.request_id, stop))
                    break
            comp.token_ids.extend(tokens)
            comp.delta_token_ids.extend(tokens)
            lps = co.new_logprobs[: len(tokens)]
            comp.delta_logprobs.extend(lps)
            if comp.logprobs is not None:
                comp.logprobs.extend(lps)
            if co.finish_reason is not None and not comp.finished:
                comp.finish_reason, comp.stop_reason = co.finish_reason, co.stop_reason
        results = []
        for gid, group in touched.items():
            for comp, detok in zip(group.outputs, group.detokenizers):
                comp.delta_text = detok.take_delta(comp.finished)
                comp.text = detok.text[: detok.emitted]
            # One failed choice fails the request: its siblings are dropped, not waited for.
            finished = group.error is not None or all(o.finished for o in group.outputs)
            metrics = {**group.metrics, **({"time": now} if now is not None else {})}
            results.append(
                RequestOutput(
                    gid,
                    group.prompt,
                    group.prompt_token_ids,
                    group.outputs,
                    finished=finished,
                    num_cached_tokens=group.num_cached_tokens,
                    prompt_logprobs=group.prompt_logprobs,
                    metrics=metrics,
                    error=group.error,
                    embedding=group.embedding,
                )
            )
            if finished:
                del self.groups[gid]
        return results, stops
