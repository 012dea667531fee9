"""The gateway: one OpenAI endpoint in front of many replicas."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from shoal.fleet.config import GatewayConfig
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.policies import RouteRequest, make_policy
from shoal.fleet.prefix_index import PrefixIndex
from shoal.fleet.proxy import Forward, Proxy
from shoal.fleet.registry import Registry
from shoal.fleet.replica import ReplicaState
from shoal.models.chat_template import template_message
from shoal.models.tokenizer import Tokenizer
from shoal.protocol.auth import bearer_matches
from shoal.protocol.block_hash import hash_blocks
from shoal.protocol.errors import error_body

log = logging.getLogger(__name__)

FORWARDED_HEADERS = ("authorization", "x-request-id", "content-type")
TEXT_BLOCK_BYTES = 64  # without the model's tokenizer, prompts are hashed in blocks of bytes


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


class Gateway:
    def __init__(self, config: GatewayConfig, launcher=None):
        self.config = config
        self.metrics = GatewayMetrics()
        self.index = PrefixIndex()
        self.policy = make_policy(config.policy, self.index, config.load_weight, config.imbalance_limit)
        self.registry = Registry(config, self.policy, self.index, self.metrics)
        self.launcher = launcher  # starts and supervises local replicas, when the fleet owns them
        self.tokenizer: Tokenizer | None = None
        self.proxy: Proxy | None = None
        for i, url in enumerate(config.backends):
            self.registry.add(f"backend-{i}", url)

    # --- routing keys --------------------------------------------------------------------

    def _prompt_ids(self, path: str, body: dict) -> list[int] | None:
        tok = self.tokenizer
        if path.endswith("chat/completions"):
            messages = body.get("messages")
            if tok is None or not isinstance(messages, list):
                return None
            # Rendered as the replica renders them (developer as system too), so the hashes agree.
            flat = [m if isinstance(m, dict) else {} for m in messages]
            return tok.encode_chat([template_message(m.get("role", "user"), m.get("content")) for m in flat])
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]  # several prompts: route by the first
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and tok is not None:
            return tok.encode(prompt)
        return None

    def route_request(self, path: str, body: dict, headers) -> RouteRequest:
        session = headers.get(self.config.session_header) or body.get("user")
        try:
            ids = self._prompt_ids(path, body)
        except Exception:  # a prompt the template refuses: the replica will say why
            ids = None
        if ids is not None:
            hashes = hash_blocks(ids, self.registry.block_size)
        else:
            text = json.dumps(body.get("messages") or body.get("prompt") or "", sort_keys=True)
            hashes = hash_blocks(list(text.encode()), TEXT_BLOCK_BYTES)
        return RouteRequest(hashes, session if isinstance(session, str) else None)

    # --- app -----------------------------------------------------------------------------

    def build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            await self.start()
            try:
                yield
            finally:
                await self.stop()

        app = FastAPI(title="shoal gateway", lifespan=lifespan)

        async def forward(raw: Request, path: str):
            key = self.config.api_key
            if key and not bearer_matches(raw.headers.get("authorization", ""), key):
                return _error(401, "invalid or missing API key", code="invalid_api_key")
            try:
                body = json.loads(await raw.body())
            except ValueError:
                return _error(400, "the request body is not valid JSON")
            if not isinstance(body, dict):
                return _error(400, "the request body must be a JSON object")
            headers = {k: v for k in FORWARDED_HEADERS if (v := raw.headers.get(k))}
            fwd = Forward(path, body, headers, self.route_request(path, body, raw.headers), time.monotonic())
            resp = await self.proxy.handle(fwd)
            self.metrics.responses.labels(str(resp.status_code)).inc()
            return resp

        @app.post("/v1/completions")
        async def completions(raw: Request):
            return await forward(raw, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(raw: Request):
            return await forward(raw, "/v1/chat/completions")

        @app.post("/tokenize")
        async def tokenize(raw: Request):
            return await forward(raw, "/tokenize")

        @app.post("/detokenize")
        async def detokenize(raw: Request):
            return await forward(raw, "/detokenize")

        @app.get("/v1/models")
        async def models():
            ready = [r for r in self.registry.replicas.values() if r.state == ReplicaState.READY]
            answers = await asyncio.gather(
                *(self.proxy.client.get(r.url + "/v1/models", timeout=5) for r in ready),
                return_exceptions=True,
            )
            cards: dict[str, Any] = {}
            for a in answers:
                if not isinstance(a, Exception) and a.status_code == 200:
                    for card in a.json().get("data", []):
                        cards.setdefault(card["id"], card)
            return {"object": "list", "data": list(cards.values())}

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/ready")
        async def ready():
            n = sum(r.state == ReplicaState.READY for r in self.registry.replicas.values())
            return JSONResponse({"ready": n > 0, "replicas_ready": n}, status_code=200 if n else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/replicas")
        async def replicas():
            return {
                "policy": self.policy.name,
                "replicas": [r.snapshot() for r in self.registry.replicas.values()],
            }

        return app

    async def start(self) -> None:
        self.proxy = Proxy(self.config, self.registry, self.metrics)
        if self.launcher is not None:
            await self.launcher.start(self.registry)
        await self.registry.start()
        try:
            from shoal.models.checkpoint import load_tokenizer

            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer)
        except Exception as exc:  # a foreign model: route on text blocks instead
            log.warning("no tokenizer for prefix routing (%s); hashing prompt text instead", exc)

    async def stop(self) -> None:
        if self.launcher is not None:
            await self.launcher.stop()
        await self.registry.stop()
        if self.proxy is not None:
            await self.proxy.aclose()
