"""The gateway: one OpenAI endpoint in front of many replicas."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from shoal.fleet.config import GatewayConfig
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.policies import RouteRequest, make_policy
from shoal.fleet.prefix_index import PrefixIndex
from shoal.fleet.proxy import Forward, Proxy
from shoal.fleet.registry import Registry
from shoal.fleet.replica import ReplicaState
from shoal.fleet.status_page import status_html
from shoal.models.chat_template import template_message
from shoal.models.tokenizer import Tokenizer
from shoal.models.tool_formats import conversation, offered_tools, tool_format
from shoal.protocol.auth import bearer_matches
from shoal.protocol.block_hash import NONE_HASH, hash_blocks, root_hash
from shoal.protocol.bodies import BodyLimitMiddleware, parse_json_object
from shoal.protocol.errors import APIError, install_error_handlers
from shoal.protocol.secrets import kv_salt

log = logging.getLogger(__name__)

TEXT_BLOCK_BYTES = 64  # without the model's tokenizer, prompts are hashed in blocks of bytes
# Bodies past this are parsed on a worker thread: a 4 MiB JSON body takes tens of milliseconds.
PARSE_INLINE_BYTES = 64 * 1024


def _prompt_chars(path: str, body: dict) -> int:
    """About how many characters tokenizing the prompt would read (a bound, not an exact count)."""
    if path.endswith("chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        total = 16 * len(messages)  # the template's own text per message
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return len(prompt) if isinstance(prompt, str | list) else 0


class Gateway:
    def __init__(self, config: GatewayConfig, controller=None):
        self.config = config
        self.metrics = GatewayMetrics()
        self.index = PrefixIndex()
        self.policy = make_policy(config.policy, self.index, config.load_weight, config.imbalance_limit)
        self.registry = Registry(config, self.policy, self.index, self.metrics)
        self.controller = controller  # runs the replicas (FleetController), when the fleet owns them
        self.tokenizer: Tokenizer | None = None
        self.proxy: Proxy | None = None
        self.kv_root = NONE_HASH
        for i, url in enumerate(config.backends):
            self.registry.add(f"backend-{i}", url)

    # --- routing keys --------------------------------------------------------------------

    def _prompt_ids(self, path: str, body: dict) -> list[int] | None:
        tok = self.tokenizer
        if path.endswith("chat/completions"):
            messages = body.get("messages")
            if tok is None or not isinstance(messages, list):
                return None
            # Rendered as the replica renders them (developer as system, tools offered in the
            # template's way), so the hashes agree.
            flat = [m if isinstance(m, dict) else {} for m in messages]
            rendered, kwargs = conversation(
                [
                    template_message(
                        m.get("role", "user"), m.get("content"), m.get("tool_calls"), m.get("tool_call_id")
                    )
                    for m in flat
                ],
                offered_tools(body),
                tool_format("auto", tok.chat_template),
                tok.chat_template,
            )
            return tok.encode_chat(
                rendered, add_generation_prompt=body.get("add_generation_prompt") is not False, **kwargs
            )
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # several prompts: route by the first
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and tok is not None:
            return tok.encode(prompt)
        return None

    def _route_hashes(self, path: str, body: dict) -> list[int]:
        """Runs on a worker thread. A prompt too long for any context is not tokenized: the
        replica refuses it anyway, and tokenizing megabytes would hold a thread for seconds."""
        limit = self.config.route_tokenize_max_chars
        ids = None
        if _prompt_chars(path, body) <= limit:
            try:
                ids = self._prompt_ids(path, body)
            except Exception:  # a prompt the template refuses: the replica will say why
                ids = None
        if ids is not None:
            return hash_blocks(ids[:limit], self.registry.block_size, root=self.kv_root)
        prompt = body.get("messages") or body.get("prompt") or ""
        if isinstance(prompt, str):
            text = prompt[:limit]
        else:
            text = json.dumps(prompt, sort_keys=True, ensure_ascii=False)[:limit]
        return hash_blocks(list(text.encode("utf-8", "replace")), TEXT_BLOCK_BYTES)

    async def route_request(self, path: str, body: dict, headers) -> RouteRequest:
        session = headers.get(self.config.session_header) or body.get("user")
        model = None
        if self.controller is not None and self.controller.multi_model:
            model = body.get("model")
            if not self.controller.serves(model):
                names = ", ".join(m.name for m in self.controller.models)
                raise APIError(
                    404,
                    f"the model {str(model)[:100]!r} does not exist; this fleet serves {names}",
                    "model",
                    "model_not_found",
                )
        hashes = await asyncio.to_thread(self._route_hashes, path, body)
        return RouteRequest(hashes, session if isinstance(session, str) else None, model=model)

    # --- requests ------------------------------------------------------------------------

    def check_key(self, raw: Request) -> None:
        key = self.config.api_key
        if key and not bearer_matches(raw.headers.get("authorization", ""), key):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    def check_admin(self, raw: Request) -> None:
        """Fleet changes: with an API key, whoever holds it; without one, only this host."""
        if self.controller is None:
            raise APIError(400, "this gateway runs no fleet of its own (it fronts --backend replicas)")
        if self.config.api_key:
            return self.check_key(raw)
        client = raw.client.host if raw.client else ""
        if client not in ("127.0.0.1", "::1", "localhost"):
            raise APIError(403, "fleet changes come from this host, or with the gateway's API key")
        return None

    def upstream_headers(self, raw: Request | None = None) -> dict[str, str]:
        """The replica's key when the gateway has one; else the client's own passes through."""
        headers = {}
        if raw is not None:
            headers = {k: v for k in ("x-request-id", "content-type") if (v := raw.headers.get(k))}
        key = self.config.replica_key
        if key:
            headers["authorization"] = f"Bearer {key}"
        elif raw is not None and (auth := raw.headers.get("authorization")):
            headers["authorization"] = auth
        return headers

    def clamp_priority(self, body: dict) -> None:
        """Lower values run first and 0 is the default: a client may only give itself less."""
        p = body.get("priority")
        if not self.config.trust_client_priority and isinstance(p, int) and not isinstance(p, bool):
            body["priority"] = max(p, 0)

    async def forward(self, raw: Request, path: str) -> Response:
        try:
            self.check_key(raw)
            data = await raw.body()
            if len(data) > PARSE_INLINE_BYTES:
                body = await asyncio.to_thread(parse_json_object, data)
            else:
                body = parse_json_object(data)
            self.clamp_priority(body)
            if body.pop("kv_transfer_params", None) is not None:
                raise APIError(
                    400, "kv_transfer_params is set by the gateway, not by clients", "kv_transfer_params"
                )
            route = await self.route_request(path, body, raw.headers)
            fwd = Forward(path, body, self.upstream_headers(raw), route, time.monotonic(), len(data))
            resp = await self.proxy.handle(fwd)
        except APIError as exc:
            resp = exc.response()
        self.metrics.responses.labels(str(resp.status_code)).inc()
        return resp

    async def list_models(self, raw: Request) -> dict[str, Any]:
        ready = [r for r in self.registry.replicas.values() if r.state == ReplicaState.READY]
        headers = self.upstream_headers(raw)
        answers = await asyncio.gather(
            *(self.proxy.client.get(r.url + "/v1/models", headers=headers, timeout=5) for r in ready),
            return_exceptions=True,
        )
        cards: dict[str, Any] = {}
        if self.controller is not None and self.controller.multi_model:  # also those scaled to zero
            for m in self.controller.models:
                cards[m.name] = {"id": m.name, "object": "model", "created": 0, "owned_by": "shoal"}
        for a in answers:
            if not isinstance(a, BaseException) and a.status_code == 200:
                with contextlib.suppress(ValueError, AttributeError, KeyError, TypeError):
                    for card in a.json().get("data", []):
                        cards.setdefault(card["id"], card)
        return {"object": "list", "data": list(cards.values())}

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
        install_error_handlers(app)
        app.add_middleware(BodyLimitMiddleware, max_bytes=self.config.max_body_bytes)

        @app.post("/v1/completions")
        async def completions(raw: Request):
            return await self.forward(raw, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(raw: Request):
            return await self.forward(raw, "/v1/chat/completions")

        @app.post("/tokenize")
        async def tokenize(raw: Request):
            return await self.forward(raw, "/tokenize")

        @app.post("/detokenize")
        async def detokenize(raw: Request):
            return await self.forward(raw, "/detokenize")

        @app.get("/v1/models")
        async def models(raw: Request):
            self.check_key(raw)
            return await self.list_models(raw)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/ready")
        async def ready():
            n = sum(r.state == ReplicaState.READY for r in self.registry.replicas.values())
            # A model scaled to zero still takes requests: they wait for a replica to start.
            scalable = self.controller is not None and any(p.autoscaler for p in self.controller.pools)
            ok = n > 0 or scalable
            return JSONResponse({"ready": ok, "replicas_ready": n}, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/status")
        async def status_page():
            return HTMLResponse(status_html())

        @app.get("/fleet/state")
        async def fleet_state(raw: Request):
            """The status page's data: pools, replicas, decisions and the last minutes' samples."""
            self.check_key(raw)
            c = self.controller
            return {
                "pools": c.snapshot() if c is not None else [],
                "replicas": [r.snapshot() for r in self.registry.replicas.values()],
                "decisions": list(c.history.decisions) if c is not None else [],
                "history": list(c.history.samples) if c is not None else [],
            }

        @app.post("/fleet/update")
        async def fleet_update(raw: Request):
            """Starts a rolling update (`shoal fleet update`)."""
            self.check_admin(raw)
            body = parse_json_object(await raw.body())
            changes = {k: body[k] for k in ("model", "replica_args") if body.get(k) is not None}
            args = changes.get("replica_args", [])
            canary, canary_s = body.get("canary", 0.0), body.get("canary_s", 30.0)
            if (
                not isinstance(changes.get("model", ""), str)
                or not isinstance(args, list)
                or not all(isinstance(a, str) for a in args)
                or not isinstance(canary, int | float)
                or not 0 <= canary <= 1
                or not isinstance(canary_s, int | float)
                or canary_s < 0
            ):
                raise APIError(400, "give model (a path), replica_args (strings), canary (0-1), canary_s")
            try:
                pools = self.controller.update(
                    body.get("model_name"), changes, float(canary), float(canary_s)
                )
            except ValueError as exc:
                raise APIError(400, str(exc)) from None
            return JSONResponse({"updating": pools}, status_code=202)

        @app.get("/replicas")
        async def replicas(raw: Request):
            self.check_key(raw)  # it shows replica URLs and process ids
            out = {
                "policy": self.policy.name,
                "replicas": [
                    {**r.snapshot(), "cached_blocks": self.index.size(r.name)}
                    for r in self.registry.replicas.values()
                ],
            }
            if self.controller is not None:
                out["pools"] = self.controller.snapshot()
            return out

        return app

    async def start(self) -> None:
        self.kv_root = root_hash(kv_salt(self.config.kv_salt, self.config.replica_key))
        self.registry.kv_root = self.kv_root
        self.proxy = Proxy(self.config, self.registry, self.metrics)
        if self.controller is not None:
            await self.controller.start(self.registry)
        await self.registry.start()
        try:
            from shoal.models.checkpoint import load_tokenizer

            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer)
        except Exception as exc:  # a foreign model: route on text blocks instead
            log.warning("no tokenizer for prefix routing (%s); hashing prompt text instead", exc)

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop()
        await self.registry.stop()
        if self.proxy is not None:
            await self.proxy.aclose()
