"""POST /v1/completions: text or token prompts, echo, logprobs, n, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from shoal.engine.outputs import TokenLogprob
from shoal.protocol.errors import APIError
from shoal.protocol.sse import SSE_DONE, sse
from shoal.server.common import (
    ServingContext,
    close_all,
    close_timers,
    handoff,
    merged,
    now_s,
    open_streams,
    params_or_400,
    request_id,
    resumed_params,
    run_to_end,
    stream_error,
    usage,
)
from shoal.server.protocol import CompletionRequest


@dataclass
class _Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt: int = 0  # which prompt of the request it continues


class _Logprobs:
    """Completion-style logprobs: parallel lists of tokens, logprobs, top alternatives, offsets."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    def add(self, c: _Choice, lps: list[TokenLogprob | None], token_ids: list[int], offset: int) -> dict:
        part: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, lp in zip(token_ids, lps):
            text = self.ctx.token_text(tok)
            part["tokens"].append(text)
            part["token_logprobs"].append(None if lp is None else lp.logprob)
            top = None
            if lp is not None:
                top = {self.ctx.token_text(t): v for t, v in lp.top}
                top.setdefault(text, lp.logprob)
            part["top_logprobs"].append(top)
            part["text_offset"].append(offset)
            offset += len(text)
        for key, values in part.items():
            getattr(c, key).extend(values)
        return part


def _check(req: CompletionRequest) -> None:
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of must equal n (beam-style best_of is not supported)", "best_of")
    if req.stream and req.n > 1 and req.echo:
        raise APIError(400, "echo with n > 1 is not supported when streaming", "echo")


async def create_completion(req: CompletionRequest, raw: Request, ctx: ServingContext):
    lora = ctx.check_model(req.model)
    _check(req)
    resume = req.resume
    echo = req.echo and resume is None
    prompt_lp = req.logprobs if echo and req.logprobs is not None else None
    params = params_or_400(
        lambda: resumed_params(
            req.sampling_params(req.max_tokens, req.logprobs, prompt_logprobs=prompt_lp), resume
        )
    )
    if resume is not None:
        prompts = [resume.prompt_token_ids]
    else:
        prompts = [await ctx.encode(p, "prompt") if isinstance(p, str) else p for p in req.prompts()]
    if any(not p for p in prompts):
        raise APIError(400, "prompt is empty", "prompt")
    rid = request_id("cmpl")
    streams = await open_streams(
        ctx, rid, prompts, params, req.priority, resume, req.kv_transfer_params, raw, lora
    )
    start = raw.state.arrival
    timers = [ctx.metrics.timer(start, lora) for _ in streams]
    lp = _Logprobs(ctx) if req.logprobs is not None else None
    prior = len(resume.output_token_ids) if resume is not None else 0
    first_index = resume.index if resume is not None else 0
    choices = [
        _Choice(first_index + i, prompt=i // req.n, num_tokens=prior) for i in range(len(prompts) * req.n)
    ]
    cached = [0] * len(prompts)
    head = {"id": rid, "object": "text_completion", "created": now_s(), "model": lora or ctx.model_name}

    def echo_prefix(p: int, c: _Choice, out) -> dict | None:
        """Prompt text (and its logprobs) that opens an echoed choice."""
        c.text = ctx.tokenizer.decode(prompts[p], skip_special_tokens=False)
        if lp is None:
            return None
        return lp.add(c, out.prompt_logprobs or [None] * len(prompts[p]), prompts[p], 0)

    async def events() -> AsyncIterator[tuple[_Choice, str, dict | None, bool, list[int]]]:
        """(choice, new text, new logprobs, finished now, new token ids) as outputs arrive."""
        started: set[int] = set()
        async for p, out in merged(streams):
            timers[p].observe(out)
            cached[p] = out.num_cached_tokens
            for o in out.outputs:
                c = choices[p * req.n + o.index]
                part, text = None, ""
                if echo and c.index not in started:
                    part = echo_prefix(p, c, out)
                    text = c.text
                started.add(c.index)
                if lp is not None and o.delta_logprobs:
                    more = lp.add(c, o.delta_logprobs, o.delta_token_ids, len(c.text))
                    part = more if part is None else {k: part[k] + more[k] for k in part}
                c.text += o.delta_text
                text += o.delta_text
                c.num_tokens += len(o.delta_token_ids)
                c.token_ids += o.delta_token_ids
                finished_now = o.finish_reason is not None and c.finish_reason is None
                if finished_now:
                    c.finish_reason = o.finish_reason
                ids = o.delta_token_ids if req.return_token_ids else []
                if text or part is not None or finished_now or ids:
                    yield c, text, part, finished_now, ids

    def num_completion() -> int:
        return sum(c.num_tokens for c in choices)

    num_prompt = sum(len(p) for p in prompts)

    def total_usage() -> dict:
        return usage(num_prompt, num_completion(), sum(cached))

    if not req.stream:
        try:
            await run_to_end(raw, events(), streams)
        finally:
            close_timers(timers)
        body = {
            **head,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": None
                    if lp is None
                    else {
                        k: getattr(c, k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                    },
                    "finish_reason": c.finish_reason,
                    **(
                        {"token_ids": c.token_ids, "prompt_token_ids": prompts[c.prompt]}
                        if req.return_token_ids
                        else {}
                    ),
                }
                for c in choices
            ],
            "usage": total_usage(),
            **handoff(ctx, req.kv_transfer_params, rid),
        }
        return JSONResponse(body)

    async def stream():
        try:
            announced: set[int] = set()
            async for c, text, part, finished_now, ids in events():
                choice = {
                    "index": c.index,
                    "text": text,
                    "logprobs": part,
                    "finish_reason": c.finish_reason if finished_now else None,
                }
                if req.return_token_ids:
                    choice["token_ids"] = ids
                    if c.index not in announced:
                        announced.add(c.index)
                        choice["prompt_token_ids"] = prompts[c.prompt]
                yield sse({**head, "choices": [choice]})
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": total_usage()})
        except Exception as exc:
            yield sse(stream_error(exc))
        finally:
            close_all(streams)
            close_timers(timers)
        yield SSE_DONE

    return StreamingResponse(stream(), media_type="text/event-stream")
