"""POST /v1/chat/completions: chat template, logprobs / top_logprobs, n, streaming."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from shoal.engine.outputs import TokenLogprob
from shoal.engine.structured import StructuredOutput
from shoal.models.chat_prompt import chat_token_ids
from shoal.models.chat_template import ChatTemplateError
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
from shoal.server.protocol import ChatCompletionRequest
from shoal.server.tool_parser import ParsedDelta, ToolCallParser


async def chat_prompt(
    ctx: ServingContext, messages, add_generation_prompt: bool, tools: list[dict] | None = None
) -> list[int]:
    """The rendered, tokenized conversation (off the event loop: it may be long), with `tools`
    offered to the model in its chat template's way."""
    flat = [m.as_template_message() for m in messages]
    ctx.check_text_length(
        sum(len(m.get("content") or "") + len(str(m.get("tool_calls") or "")) for m in flat)
        + len(json.dumps(tools or [])),
        "messages",
    )
    try:
        return await ctx.run_off_loop(
            chat_token_ids, ctx.tokenizer, flat, tools, ctx.tool_format, add_generation_prompt
        )
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), "messages") from None


def tool_grammar(ctx: ServingContext, req: ChatCompletionRequest) -> StructuredOutput | None:
    """The grammar a required or named tool_choice puts on the output. Offered tools are compiled
    even when nothing is forced, so a tool whose parameters are not a usable schema is a 400."""
    tools = req.active_tools
    if not tools:
        return None
    forced = req.forced_tools
    grammar = StructuredOutput(
        "grammar", ctx.tool_format.grammar(forced or tools, req.parallel_tool_calls), "tools"
    )
    grammar.grammar()
    return grammar if forced else None


def _entry(ctx: ServingContext, token_id: int, logprob: float) -> dict:
    text = ctx.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _content_logprobs(ctx: ServingContext, lps: list[TokenLogprob]) -> list[dict]:
    return [
        {**_entry(ctx, lp.token_id, lp.logprob), "top_logprobs": [_entry(ctx, t, v) for t, v in lp.top]}
        for lp in lps
    ]


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, ctx: ServingContext):
    lora = ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    resume = req.resume
    params = params_or_400(lambda: resumed_params(req.sampling_params(req.token_limit, logprobs), resume))
    forced = params_or_400(lambda: tool_grammar(ctx, req))
    if forced is not None:
        params = dataclasses.replace(params, structured=forced)
    parsers = [ToolCallParser(ctx.tool_format) for _ in range(req.n)] if req.active_tools else None
    if resume is not None:
        prompt = resume.prompt_token_ids
        if parsers:
            # The client has what the parser made of the prior text: read it again silently, and
            # have the engine send only text past it.
            prior = ctx.tokenizer.decode(resume.output_token_ids)
            parsers[0].feed(prior)
            resume = resume.model_copy(update={"text_offset": len(prior)})
    else:
        prompt = await chat_prompt(ctx, req.messages, req.add_generation_prompt, req.active_tools)
    rid = request_id("chatcmpl")
    streams = await open_streams(
        ctx, rid, [prompt], params, req.priority, resume, req.kv_transfer_params, raw, lora
    )
    timer = ctx.metrics.timer(raw.state.arrival, lora)
    head = {"id": rid, "created": now_s(), "model": lora or ctx.model_name}
    # A resumed stream answers for one choice of the original request, under that choice's index.
    first_index = resume.index if resume is not None else 0
    texts = [""] * req.n  # content: the text, less any tool calls read out of it
    counts = [len(resume.output_token_ids) if resume is not None else 0] * req.n
    cached = [0]
    finish: list[str | None] = [None] * req.n
    content_lps: list[list[dict]] = [[] for _ in range(req.n)]

    token_ids: list[list[int]] = [[] for _ in range(req.n)]

    async def events() -> AsyncIterator[tuple[int, ParsedDelta, list[dict] | None, bool, list[int]]]:
        """(choice, new content and tool calls, new logprobs, finished now, new token ids) as
        outputs arrive."""
        async for _, out in merged(streams):
            timer.observe(out)
            cached[0] = out.num_cached_tokens
            for o in out.outputs:
                i = o.index
                part = (
                    _content_logprobs(ctx, o.delta_logprobs)
                    if logprobs is not None and o.delta_logprobs
                    else None
                )
                if part:
                    content_lps[i].extend(part)
                finished_now = o.finish_reason is not None and finish[i] is None
                if parsers is None:
                    parsed = ParsedDelta(o.delta_text)
                else:
                    parsed = parsers[i].feed(o.delta_text)
                    if finished_now:
                        rest = parsers[i].finish()
                        parsed.content += rest.content
                        parsed.calls += rest.calls
                texts[i] += parsed.content
                counts[i] += len(o.delta_token_ids)
                token_ids[i] += o.delta_token_ids
                if finished_now:
                    called = parsers is not None and parsers[i].called
                    finish[i] = "tool_calls" if called and o.finish_reason == "stop" else o.finish_reason
                ids = o.delta_token_ids if req.return_token_ids else []
                if parsed or part or finished_now or ids:
                    yield i, parsed, part, finished_now, ids

    def total_usage() -> dict:
        return usage(len(prompt), sum(counts), cached[0])

    def message(i: int) -> dict:
        calls = parsers[i].calls if parsers is not None else []
        if not calls:
            return {"role": "assistant", "content": texts[i], "refusal": None}
        return {
            "role": "assistant",
            "content": texts[i] or None,
            "refusal": None,
            "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        }

    if not req.stream:
        try:
            await run_to_end(raw, events(), streams)
        finally:
            close_timers([timer])
        body = {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": first_index + i,
                    "message": message(i),
                    "logprobs": None if logprobs is None else {"content": content_lps[i], "refusal": None},
                    "finish_reason": finish[i],
                    **(
                        {"token_ids": token_ids[i], "prompt_token_ids": prompt}
                        if req.return_token_ids
                        else {}
                    ),
                }
                for i in range(req.n)
            ],
            "usage": total_usage(),
            **handoff(ctx, req.kv_transfer_params, rid),
        }
        return JSONResponse(body)

    chunk_head = {**head, "object": "chat.completion.chunk"}

    def chunk(i: int, delta: dict, part, finish_reason, ids: list[int] | None = None, **top) -> str:
        choice = {
            "index": first_index + i,
            "delta": delta,
            "logprobs": None if part is None else {"content": part, "refusal": None},
            "finish_reason": finish_reason,
        }
        if ids is not None:
            choice["token_ids"] = ids
        return sse({**chunk_head, "choices": [choice], **top})

    async def stream():
        try:
            for i in range(req.n if resume is None else 0):  # a resumed stream's client has its role
                top = {"prompt_token_ids": prompt} if req.return_token_ids else {}
                yield chunk(i, {"role": "assistant", "content": ""}, None, None, **top)
            async for i, parsed, part, finished_now, ids in events():
                delta: dict = {"content": parsed.content} if parsed.content else {}
                if parsed.calls:
                    delta["tool_calls"] = [c.as_openai() for c in parsed.calls]
                yield chunk(
                    i, delta, part, finish[i] if finished_now else None, ids if req.return_token_ids else None
                )
            if req.include_usage:
                yield sse({**chunk_head, "choices": [], "usage": total_usage()})
        except Exception as exc:
            yield sse(stream_error(exc))
        finally:
            close_all(streams)
            close_timers([timer])
        yield SSE_DONE

    return StreamingResponse(stream(), media_type="text/event-stream")
