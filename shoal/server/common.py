"""What the completion and chat handlers share: the serving context, admission, streaming helpers."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from shoal.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestStream
from shoal.engine.outputs import RequestOutput
from shoal.engine.request_checks import RequestRejectedError
from shoal.engine.sampling_params import InvalidParamError, SamplingParams
from shoal.models.tokenizer import Tokenizer
from shoal.models.tool_formats import SMOLLM2, ToolFormat
from shoal.protocol.disconnect import unless_client_leaves
from shoal.protocol.errors import RANK_LOST_CODE, APIError, overloaded
from shoal.protocol.resume import Resume
from shoal.protocol.seeds import derive_seed
from shoal.server.kv_connector import KVConnector
from shoal.server.metrics import RequestTimer, ServerMetrics
from shoal.server.protocol import KVTransferParams


@dataclass
class ServingContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    trust_request_priority: bool = False
    tool_format: ToolFormat = SMOLLM2
    kv: KVConnector | None = None  # prefill/decode handoff; None: kv_transfer_params are refused
    # The LoRA adapters a request may name as its model (kept by the load and unload routes); None:
    # adapters are not enabled.
    adapters: dict[str, str] | None = None
    pooling: str = "last"  # how /v1/embeddings pools the final hidden states
    embedding_width: int = 0  # the model's hidden size: an embedding's length
    # Tokenizing a long prompt takes a while: it must never stall the event loop (and with it
    # /health and every other stream), so it runs here.
    text_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="shoal-tokenize")
    )
    _token_text: dict[int, str] = field(default_factory=dict)

    async def run_off_loop(self, fn: Callable, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.text_pool, functools.partial(fn, *args, **kwargs))

    def check_text_length(self, chars: int, param: str) -> None:
        """A fast 400 for text that surely has more tokens than any request may (see
        Tokenizer.max_token_chars), before anything tokenizes it."""
        if chars > self.max_model_len * self.tokenizer.max_token_chars:
            raise APIError(
                400,
                f"the {param} has {chars} characters, more than this model's maximum context length of "
                f"{self.max_model_len} tokens can hold",
                param,
                "context_length_exceeded",
            )

    async def encode(self, text: str, param: str, **kwargs) -> list[int]:
        self.check_text_length(len(text), param)
        return await self.run_off_loop(self.tokenizer.encode, text, **kwargs)

    def priority(self, requested: int) -> int:
        """Lower runs first, 0 is the default: an untrusted client may only lower its own."""
        return requested if self.trust_request_priority else max(requested, 0)

    def check_model(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model), or a 404."""
        if model is None or model == self.model_name:
            return None
        if self.adapters is not None and model in self.adapters:
            return model
        served = [self.model_name, *sorted(self.adapters or ())]
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves {', '.join(map(repr, served))}",
            "model",
            "model_not_found",
        )

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def request_id(prefix: str) -> str:
    # Not the client's x-request-id: that one is echoed back, but two clients may reuse it.
    return f"{prefix}-{uuid.uuid4().hex}"


def params_or_400(build) -> SamplingParams:
    try:
        return build()
    except InvalidParamError as exc:
        raise APIError(400, str(exc), exc.param) from None


async def open_streams(
    ctx: ServingContext,
    rid: str,
    prompts: list[list[int]],
    params: SamplingParams,
    priority: int,
    resume: Resume | None = None,
    kv: KVTransferParams | None = None,
    raw: Request | None = None,
    lora: str | None = None,
) -> list[RequestStream]:
    """Admits one engine request per prompt, all or none. `kv`: the request's part in a prefill/
    decode handoff (see server.kv_connector)."""
    streams: list[RequestStream] = []
    extra = {}
    if resume is not None:
        extra = {"prior_output_ids": resume.output_token_ids, "prior_text_sent": resume.text_offset}
    if lora is not None:
        extra["lora"] = lora
    if kv is not None:
        if ctx.kv is None:
            raise APIError(400, "this server takes no kv_transfer_params", "kv_transfer_params")
        # A resumed request's blocks cover its earlier output too (a migrated stream's K/V).
        prior = list(resume.output_token_ids) if resume is not None else []
        extra.update(await ctx.kv.request_options(kv, raw, [p + prior for p in prompts], lora))
    try:
        for i, ids in enumerate(prompts):
            name = rid if len(prompts) == 1 else f"{rid}-{i}"
            streams.append(await _add(ctx, name, ids, params, priority, extra))
    except BaseException as exc:
        for s in streams:
            s.abort()
        raise engine_error(exc) from exc
    return streams


async def _add(ctx: ServingContext, name: str, ids: list[int], params, priority: int, extra: dict):
    try:
        return await ctx.engine.add_request(name, ids, params, ctx.priority(priority), **extra)
    except RequestRejectedError as exc:
        if "external_kv" not in extra or exc.param != "kv_transfer_params":
            raise
        reason = str(exc)
    ctx.kv.rejected(reason)  # pulled K/V that does not fit this prompt: compute it here instead
    extra = {k: v for k, v in extra.items() if k != "external_kv"}
    return await ctx.engine.add_request(name, ids, params, ctx.priority(priority), **extra)


def handoff(ctx: ServingContext, kv: KVTransferParams | None, rid: str) -> dict:
    """A prefill worker's answer names the K/V it holds for the decode worker to pull."""
    if kv is None or not kv.do_remote_decode:
        return {}
    return {"kv_transfer_params": ctx.kv.handoff(rid)}


class RequestFailedError(Exception):
    """A step failed for this request; the engine went on without it."""


def check_output(out: RequestOutput) -> RequestOutput:
    if out.error is not None:
        raise RequestFailedError(out.error)
    return out


def resumed_params(params: SamplingParams, resume: Resume | None) -> SamplingParams:
    """A resumed choice draws as choice `index` of the original request would have."""
    if resume is None or resume.index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=derive_seed(params.seed, resume.index))


def engine_error(exc: BaseException) -> BaseException:
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"the request failed in the engine: {exc}", code="internal_error")
    if isinstance(exc, RequestRejectedError):
        status = 404 if exc.code == "model_not_found" else 400  # an adapter unloaded meanwhile
        return APIError(status, str(exc), exc.param, exc.code)
    if isinstance(exc, EngineOverloadedError):
        return overloaded(str(exc))
    if isinstance(exc, EngineDeadError):
        code = RANK_LOST_CODE if exc.rank_lost else "engine_dead"
        return APIError(503, str(exc), code=code, headers={"Retry-After": "5"})
    return exc


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, check_output(out)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream):
        try:
            async for out in s:
                await queue.put((i, check_output(out), None))
        except BaseException as exc:
            await queue.put((i, None, exc))
        await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                live -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def collect_unless_disconnected(raw: Request, work) -> object:
    """Runs `work` (a coroutine) but cancels it the moment the client goes away (a 499)."""
    try:
        return await unless_client_leaves(raw.receive, work)
    except APIError:
        raise
    except Exception as exc:
        raise engine_error(exc) from exc


async def run_to_end(raw: Request, events: AsyncIterator, streams: list[RequestStream]) -> None:
    """Consumes a non-streaming response's events, aborting everything if the client leaves."""

    async def run():
        try:
            async for _ in events:
                pass
        finally:
            close_all(streams)

    await collect_unless_disconnected(raw, run())


def close_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


def close_timers(timers: list[RequestTimer]) -> None:
    """Counts the requests that ended without finishing (client gone, failed) as aborted."""
    for t in timers:
        t.close()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now_s() -> int:
    return int(time.time())


def stream_error(exc: BaseException) -> dict:
    """An error that happens after the stream started is sent in-band, then the stream ends."""
    err = engine_error(exc)
    if isinstance(err, APIError):
        return err.body()
    return {
        "error": {
            "message": f"internal error: {type(exc).__name__}",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
