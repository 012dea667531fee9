"""The replica's FastAPI app: OpenAI routes, tokenizer routes, health, readiness, metrics, load."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import context, trace
from pydantic import BaseModel, ValidationError

from shoal.engine.lora_manager import AdapterInUseError
from shoal.models.lora import AdapterError
from shoal.protocol import tracing
from shoal.protocol.auth import bearer_matches
from shoal.protocol.bodies import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware, parse_json_object
from shoal.protocol.errors import (
    DRAINING_CODE,
    APIError,
    error_body,
    install_error_handlers,
    validation_message,
)
from shoal.protocol.supervision import GATEWAY_HEADER
from shoal.server.chat import chat_prompt, create_chat_completion
from shoal.server.common import ServingContext
from shoal.server.completions import create_completion
from shoal.server.drain import ADMITTED_PATHS, Drain
from shoal.server.embeddings import create_embedding
from shoal.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)

# Routes anyone may call even when an API key is set: probes, scrapes and the API's own schema.
# /load and /kv_events are the fleet's internal routes and need the key like the API does.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/docs", "/openapi.json"})
TRACE_HEADERS = (b"traceparent", b"tracestate")
GATEWAY_MARK = GATEWAY_HEADER.encode()


@dataclass
class ServerState:
    """What the routes read; `ctx` is set once the model has loaded."""

    api_key: str | None = None
    ctx: ServingContext | None = None
    load_error: str | None = None
    started: float = 0.0
    max_request_bytes: int = DEFAULT_MAX_BODY_BYTES
    exit_code: int = 0  # set when the server stops itself (engine loop dead)
    role: str = "both"  # prefill, decode or both: what a disaggregating gateway uses it for
    # This process, as /ready names it: a gateway tells a replica that was cut off and came back
    # from one that was restarted.
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    drain: Drain = field(default_factory=lambda: Drain(30.0))
    gateway_seen: float = 0.0  # when a gateway's request last came (see protocol/supervision.py)

    def serving(self) -> ServingContext:
        if self.ctx is None:
            reason = (
                f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            )
            raise APIError(503, reason, code="not_ready", headers={"Retry-After": "2"})
        return self.ctx


class FrontMiddleware:
    """Stamps arrival time and request id, checks the API key, counts errors. Pure ASGI, so it
    neither buffers streams nor hides client disconnects from the handlers."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        scope.setdefault("state", {}).update(arrival=time.monotonic(), request_id=rid)
        rid_header = (b"x-request-id", rid.encode("latin-1"))
        if GATEWAY_MARK in headers:
            self.state.gateway_seen = time.monotonic()
        key = self.state.api_key
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if key and scope["path"] not in OPEN_PATHS and not bearer_matches(auth, key):
            body = json.dumps(error_body(401, "invalid or missing API key", code="invalid_api_key")).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [(b"content-type", b"application/json"), rid_header],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return None

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), rid_header]
                ctx = self.state.ctx
                if message["status"] >= 400 and ctx is not None:
                    ctx.metrics.error(message["status"])
            await send(message)

        if scope["path"] not in ADMITTED_PATHS:
            return await self.app(scope, receive, send_with_id)
        drain = self.state.drain
        if drain.draining:
            message = "this replica is shutting down; send the request to another"
            body = json.dumps(error_body(503, message, code=DRAINING_CODE)).encode()
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"), rid_header]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return None
        drain.inflight += 1
        span = tracing.server_span(
            f"{scope['method']} {scope['path']}",
            {k.decode("latin-1"): v.decode("latin-1") for k, v in headers.items() if k in TRACE_HEADERS},
            **{"http.route": scope["path"], "shoal.request_id": rid, "shoal.role": self.state.role},
        )
        status = [500]  # what the handler answered (500 if it raised before answering)

        async def send_traced(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send_with_id(message)

        token = context.attach(trace.set_span_in_context(span))
        try:
            return await self.app(scope, receive, send_traced)
        finally:
            context.detach(token)
            tracing.end(span, status[0])
            drain.inflight -= 1


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="shoal", lifespan=lifespan, **tracing.fastapi_options())
    install_error_handlers(app)
    # Added last, runs first: a body is size-checked only after the key is.
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.max_request_bytes)
    app.add_middleware(FrontMiddleware, state=state)

    async def body_of(raw: Request, model: type[BaseModel]):
        """The body, parsed strictly (see shoal.protocol.bodies) and validated, or a 400."""
        obj = parse_json_object(await raw.body())
        try:
            return model.model_validate(obj)
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise APIError(400, message, param) from None

    defs: dict = {}  # schemas the request bodies refer to, for the OpenAPI components

    def documented(model: type[BaseModel]) -> dict:
        """The request body in the OpenAPI schema, which routes that parse their own body lack."""
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        defs.update(schema.pop("$defs", {}))
        content = {"application/json": {"schema": schema}}
        return {"openapi_extra": {"requestBody": {"required": True, "content": content}}}

    @app.post("/v1/completions", **documented(CompletionRequest))
    async def completions(raw: Request):
        body = await body_of(raw, CompletionRequest)
        return await create_completion(body, raw, state.serving())

    @app.post("/v1/chat/completions", **documented(ChatCompletionRequest))
    async def chat_completions(raw: Request):
        body = await body_of(raw, ChatCompletionRequest)
        return await create_chat_completion(body, raw, state.serving())

    @app.post("/v1/embeddings", **documented(EmbeddingRequest))
    async def embeddings(raw: Request):
        body = await body_of(raw, EmbeddingRequest)
        return await create_embedding(body, raw, state.serving())

    @app.get("/v1/models")
    async def models():
        ctx = state.serving()
        base = {"object": "model", "created": int(state.started), "owned_by": "shoal"}
        cards = [{"id": ctx.model_name, **base, "parent": None, "max_model_len": ctx.max_model_len}]
        for name, path in sorted((ctx.adapters or {}).items()):
            cards.append({"id": name, **base, "root": path, "parent": ctx.model_name})
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter", **documented(LoadLoRAAdapterRequest))
    async def load_lora_adapter(raw: Request):
        """vLLM's route: an adapter (a PEFT folder on this host) served from now on."""
        body = await body_of(raw, LoadLoRAAdapterRequest)
        ctx = state.serving()
        if ctx.adapters is None:
            raise APIError(400, "LoRA adapters are not enabled on this server (--enable-lora)", "lora_name")
        name = body.lora_name
        if name == ctx.model_name or name in ctx.adapters:
            raise APIError(400, f"the model '{name}' is already served; unload it first", "lora_name")
        try:
            await ctx.engine.add_lora(name, body.lora_path)
        except AdapterError as exc:
            raise APIError(400, str(exc), "lora_path") from None
        ctx.adapters[name] = body.lora_path
        return {"object": "lora_adapter", "id": name, "status": "loaded"}

    @app.post("/v1/unload_lora_adapter", **documented(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(raw: Request):
        body = await body_of(raw, UnloadLoRAAdapterRequest)
        ctx = state.serving()
        name = body.lora_name
        if ctx.adapters is None or name not in ctx.adapters:
            raise APIError(404, f"no adapter '{name}' is loaded", "lora_name", "model_not_found")
        try:
            await ctx.engine.remove_lora(name)
        except AdapterInUseError as exc:
            raise APIError(409, str(exc), "lora_name", "adapter_in_use") from None
        del ctx.adapters[name]
        return {"object": "lora_adapter", "id": name, "status": "unloaded"}

    @app.post("/tokenize", **documented(TokenizeRequest))
    async def tokenize(raw: Request):
        body = await body_of(raw, TokenizeRequest)
        ctx = state.serving()
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            tools = [t.function.as_tool() for t in body.tools or []]
            ids = await chat_prompt(ctx, body.messages, body.add_generation_prompt, tools)
        else:
            ids = await ctx.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize", **documented(DetokenizeRequest))
    async def detokenize(raw: Request):
        body = await body_of(raw, DetokenizeRequest)
        ctx = state.serving()
        ctx.check_model(body.model)
        vocab = ctx.tokenizer.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        text = await ctx.run_off_loop(
            ctx.tokenizer.decode, body.tokens, skip_special_tokens=body.skip_special_tokens
        )
        return {"prompt": text}

    @app.get("/health")
    async def health():
        if state.ctx is None:
            if state.load_error:
                return JSONResponse({"status": "failed", "reason": state.load_error}, status_code=503)
            return {"status": "loading"}
        ok, reason = state.ctx.engine.health()
        return JSONResponse(
            {"status": "ok" if ok else "unhealthy", "reason": reason}, status_code=200 if ok else 503
        )

    @app.get("/ready")
    async def ready():
        ctx = state.ctx
        if state.drain.draining:
            return JSONResponse({"ready": False, "draining": True}, status_code=503)
        if ctx is None or not ctx.engine.health()[0]:
            return JSONResponse({"ready": False}, status_code=503)
        return {"ready": True, "model": ctx.model_name, "instance": state.instance}

    @app.get("/metrics")
    async def metrics():
        body = state.ctx.metrics.render() if state.ctx is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/load")
    async def load():
        ctx = state.serving()
        out = {**ctx.engine.load(), "role": state.role, "draining": state.drain.draining}
        if ctx.kv is not None and ctx.kv.host:  # a peer that finds this probe shares our /dev/shm
            out["kv_host"] = ctx.kv.host
        if ctx.adapters is not None:  # what the fleet's gateway routes adapters by
            lora = ctx.engine.stats().lora
            out["lora"] = {
                "adapters": dict(ctx.adapters),
                "resident": list(lora.resident),
                "slots": lora.slots,
            }
        return out

    @app.post("/kv/pull")
    async def kv_pull(raw: Request):
        """A prefill worker's held K/V for a decode worker (shared memory or the body)."""
        ctx = state.serving()
        return await ctx.kv.serve_pull(raw, parse_json_object(await raw.body()))

    @app.post("/kv/prefix")
    async def kv_prefix(raw: Request):
        """Cached blocks of a prompt's prefix, for a peer that would otherwise compute them."""
        ctx = state.serving()
        return await ctx.kv.serve_prefix(raw, parse_json_object(await raw.body()))

    @app.post("/kv/release")
    async def kv_release(raw: Request):
        ctx = state.serving()
        return await ctx.kv.release(raw, parse_json_object(await raw.body()))

    @app.get("/kv_events")
    async def kv_events(after: Annotated[int, Query(ge=0, le=2**62)] = 0):
        """Blocks stored in and evicted from this replica's prefix cache, for the fleet router."""
        return state.serving().engine.kv_events(after)

    base_openapi = app.openapi

    def openapi() -> dict:
        schema = base_openapi()
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs)
        return schema

    app.openapi = openapi
    return app
