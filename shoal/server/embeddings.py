"""POST /v1/embeddings: each input's prompt run through the engine (in the same steps as the
generation around it) and its final hidden states pooled (see engine/pooling.py)."""

from __future__ import annotations

import base64
import math
import struct

from fastapi import Request

from shoal.engine.sampling_params import SamplingParams
from shoal.protocol.errors import APIError
from shoal.server.common import (
    ServingContext,
    close_all,
    close_timers,
    collect_unless_disconnected,
    open_streams,
    params_or_400,
    request_id,
)
from shoal.server.protocol import EmbeddingRequest


async def create_embedding(req: EmbeddingRequest, raw: Request, ctx: ServingContext) -> dict:
    lora = ctx.check_model(req.model)
    if req.dimensions is not None and req.dimensions > ctx.embedding_width:
        message = f"dimensions must be at most {ctx.embedding_width}, the model's width"
        raise APIError(400, message, "dimensions")
    prompts = []
    for x in req.inputs():
        if isinstance(x, str):
            ctx.check_text_length(len(x), "input")
            x = await ctx.encode(x, "input")
        if not x:
            raise APIError(400, "input is empty", "input")
        prompts.append(x)
    params = params_or_400(lambda: SamplingParams(max_tokens=0, pooling=ctx.pooling))
    rid = request_id("embd")
    streams = await open_streams(ctx, rid, prompts, params, req.priority, raw=raw, lora=lora)
    timers = [ctx.metrics.timer(raw.state.arrival, lora) for _ in streams]

    async def collect() -> list[list[float]]:
        found = []
        try:
            for stream, timer in zip(streams, timers):
                vec = None
                async for out in stream:
                    timer.observe(out)
                    vec = out.embedding if out.embedding is not None else vec
                if vec is None:
                    raise APIError(500, "the engine returned no embedding", code="internal_error")
                found.append(vec)
        finally:
            close_all(streams)
            close_timers(timers)
        return found

    vectors = await collect_unless_disconnected(raw, collect())
    fmt = req.encoding_format
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(_cut(v, req.dimensions), fmt)}
        for i, v in enumerate(vectors)
    ]
    tokens = sum(len(p) for p in prompts)
    return {
        "object": "list",
        "data": data,
        "model": lora or ctx.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _cut(v: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` components, of unit length again (as OpenAI's shortened embeddings)."""
    if dimensions is None or dimensions == len(v):
        return v
    head = v[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def _encode(v: list[float], fmt: str) -> list[float] | str:
    """float: a JSON list; base64: little-endian float32s, as OpenAI's SDKs decode them."""
    if fmt == "float":
        return v
    return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
