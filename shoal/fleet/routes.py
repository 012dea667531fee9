"""The gateway's HTTP app: the OpenAI routes it forwards, and its own."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from shoal.fleet.admission.store import store_errors
from shoal.fleet.admission.usage import UsageLedger
from shoal.fleet.batch.api import FILES_PATH, install_batch_routes
from shoal.fleet.batch.runner import BatchService
from shoal.fleet.catalog import ModelCatalog
from shoal.fleet.config import GatewayConfig
from shoal.fleet.control.controller import FleetController
from shoal.fleet.control.leader.leadership import Leadership
from shoal.fleet.listing import ModelListing
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.pipeline import Pipeline
from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.table import ReplicaTable
from shoal.fleet.routing.adapters import AdapterDirectory
from shoal.fleet.routing.policies import Policy
from shoal.fleet.status_page import status_html
from shoal.protocol import tracing
from shoal.protocol.auth import bearer_matches
from shoal.protocol.bodies import BodyLimitMiddleware, parse_json_object
from shoal.protocol.errors import APIError, install_error_handlers


@dataclass
class Edge:
    """What the routes answer from: the gateway's parts, as the composition root built them."""

    config: GatewayConfig
    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]
    pipeline: Pipeline
    listing: ModelListing
    catalog: ModelCatalog
    table: ReplicaTable
    index: PrefixIndex
    policy: Policy
    metrics: GatewayMetrics
    usage: UsageLedger
    batches: BatchService
    controller: FleetController | None
    adapters: AdapterDirectory
    leadership: Leadership | None = None  # several gateways over one store: who leads the fleet

    def check_key(self, raw: Request):
        return self.pipeline.authenticate(raw)

    def check_admin(self, raw: Request) -> None:
        """Fleet changes and usage: with an API key, whoever holds it; without one, only this host."""
        key = self.config.api_key
        if key:
            if not bearer_matches(raw.headers.get("authorization", ""), key):
                raise APIError(401, "this needs the gateway's own API key", code="invalid_api_key")
            return None
        client = raw.client.host if raw.client else ""
        if client not in ("127.0.0.1", "::1", "localhost"):
            raise APIError(403, "fleet changes come from this host, or with the gateway's API key")
        return None

    def check_fleet(self) -> None:
        if self.controller is None:
            raise APIError(400, "this gateway runs no fleet of its own (it fronts --backend replicas)")
        lead = self.leadership
        if lead is not None and not lead.leading:
            where = f": send it to {lead.leader}" if lead.leader else ""
            raise APIError(
                409, f"this gateway follows; the fleet's leader changes it{where}", code="not_leader"
            )

    def pools(self) -> list[dict]:
        if self.leadership is not None:
            return self.leadership.pools()
        return self.controller.snapshot() if self.controller is not None else []


def build_app(self: Edge) -> FastAPI:
    """The gateway's HTTP routes."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    app = FastAPI(title="shoal gateway", lifespan=lifespan, **tracing.fastapi_options())
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=self.config.max_body_bytes,
        path_limits={FILES_PATH: self.config.batch_max_file_bytes},
    )

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await self.pipeline.forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await self.pipeline.forward(raw, "/v1/chat/completions")

    @app.post("/v1/retrieve")
    async def retrieve(raw: Request):
        """shoal's extension: an index's nearest passages to a query (see fleet/grounding.py)."""
        return await self.pipeline.retrieve(raw)

    @app.post("/v1/embeddings")
    async def embeddings(raw: Request):
        return await self.pipeline.forward(raw, "/v1/embeddings")

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await self.pipeline.forward(raw, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await self.pipeline.forward(raw, "/detokenize")

    @app.get("/v1/models")
    async def models(raw: Request):
        tenant = self.check_key(raw)
        return await self.listing.list(tenant, self.pipeline.upstream_headers(raw))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        """vLLM's route, fleet-wide: the adapter is served by the whole fleet from now on, loaded
        on one replica now and on others as its traffic needs them."""
        self.check_admin(raw)
        body = parse_json_object(await raw.body())
        name, path = text_field(body, "lora_name"), text_field(body, "lora_path")
        model = body.get("model")
        if self.catalog.multi_model and not self.catalog.serves(model):
            raise APIError(
                400, "name the base model the adapter is for (model), one this fleet serves", "model"
            )
        if self.catalog.names_a_model(name):
            raise APIError(400, f"the model '{name}' is already served", "lora_name")
        held = await self.adapters.load(name, path, model if self.catalog.multi_model else None)
        return {"object": "lora_adapter", "id": name, "status": "loaded", "replicas": held}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        """Unloads the adapter from every replica, once the requests using it have ended."""
        self.check_admin(raw)
        name = text_field(parse_json_object(await raw.body()), "lora_name")
        left = await self.adapters.unload(name, self.config.adapter_unload_drain_s)
        return {"object": "lora_adapter", "id": name, "status": "unloaded", "replicas": left}

    @app.get("/fleet/usage")
    async def usage(raw: Request):
        """Requests and tokens per tenant and lane since the state directory began, to bill from."""
        self.check_admin(raw)
        try:
            return await self.usage.report()
        except store_errors() as exc:
            raise APIError(503, f"the usage store did not answer: {exc}", code="store_unavailable") from None

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        n = len(self.table.ready())
        # A model scaled to zero still takes requests: they wait for a replica to start.
        scalable = self.catalog.scalable
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
        self.check_admin(raw)
        c, lead = self.controller, self.leadership
        decisions = list(c.history.decisions) if c is not None else []
        if lead is not None and not lead.leading:
            decisions = lead.state.get("decisions", [])
        out = {
            "pools": self.pools(),
            "replicas": [r.snapshot() for r in self.table.replicas.values()],
            "decisions": decisions,
            "history": list(c.history.samples) if c is not None else [],
        }
        if lead is not None:
            out["leadership"] = lead.snapshot()
        return out

    @app.get("/fleet/leader")
    async def fleet_leader():
        """Which gateway of the fleet leads its controller (open, like /health: no secret in it)."""
        if self.leadership is None:
            return {"gateway": None, "leading": self.controller is not None, "leader": None, "gateways": 1}
        return self.leadership.snapshot()

    @app.post("/fleet/update")
    async def fleet_update(raw: Request):
        """Starts a rolling update (`shoal fleet update`)."""
        self.check_fleet()
        self.check_admin(raw)
        body = parse_json_object(await raw.body())
        changes = {k: body[k] for k in ("model", "replica_args") if body.get(k) is not None}
        args = changes.get("replica_args", [])
        canary, canary_s = body.get("canary", 0.0), body.get("canary_s", 30.0)
        shadow = body.get("shadow")
        if (
            not isinstance(changes.get("model", ""), str)
            or not isinstance(args, list)
            or not all(isinstance(a, str) for a in args)
            or not isinstance(canary, int | float)
            or not 0 <= canary <= 1
            or not isinstance(canary_s, int | float)
            or canary_s < 0
            or (shadow is not None and not (isinstance(shadow, int | float) and 0 <= shadow <= 1))
        ):
            raise APIError(
                400, "give model (a path), replica_args (strings), canary (0-1), canary_s, shadow (0-1)"
            )
        try:
            pools = self.controller.update(
                body.get("model_name"), changes, float(canary), float(canary_s), shadow
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return JSONResponse({"updating": pools}, status_code=202)

    @app.post("/fleet/migrate")
    async def migrate(raw: Request):
        """Moves the streams running on a replica to others, their K/V fetched from it."""
        self.check_admin(raw)
        name = text_field(parse_json_object(await raw.body()), "replica")
        if name not in self.table.replicas:
            raise APIError(404, f"no replica {name!r}", "replica")
        if not self.config.kv_transfer_key:
            raise APIError(400, "moving streams needs the fleet's K/V transfer key", "replica")
        return {"replica": name, "moved": self.table.move_streams(name)}

    @app.get("/replicas")
    async def replicas(raw: Request):
        self.check_admin(raw)  # it shows replica URLs and process ids
        out = {
            "policy": self.policy.name,
            "replicas": [
                {**r.snapshot(), "cached_blocks": self.index.size(r.name)}
                for r in self.table.replicas.values()
            ],
        }
        if self.controller is not None:
            out["pools"] = self.pools()
        if self.leadership is not None:
            out["leadership"] = self.leadership.snapshot()
        return out

    install_batch_routes(app, self.batches, self.check_key, self.config.batch_max_file_bytes)
    return app


def text_field(body: dict, name: str) -> str:
    """A required string field of an admin route's body."""
    value = body.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= 4096:
        raise APIError(400, f"{name} must be a non-empty string", name)
    return value
