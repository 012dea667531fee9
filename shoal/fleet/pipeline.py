"""The request pipeline: one client request, top to bottom.

    authenticate (the tenant whose key it carries)
    -> parse and check the body (the model the tenant may use, the priority the gateway gives it)
    -> route keys (the prompt's block hashes and token count; a tiers model picks its first tier)
    -> tenant admission (rate and token limits, charged the tokens it may use)
    -> send (the proxy: a replica through the fair queue, failover, the relays)
    -> settle (the tokens it used recorded to its tenant; the ticket closed when it ends)

Route keys come before admission because admission charges the prompt's tokens."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import context, trace

from shoal.fleet.admission.dispatch import Dispatcher
from shoal.fleet.admission.tenants import DEFAULT_COMPLETION_ESTIMATE, Tenant, Tenants, Ticket
from shoal.fleet.catalog import ModelCatalog
from shoal.fleet.config import GatewayConfig
from shoal.fleet.grounding import Grounding, annotate
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.proxy.forward import Forward
from shoal.fleet.proxy.proxy import Proxy
from shoal.fleet.proxy.shadow import Shadow
from shoal.fleet.routing.adapters import AdapterDirectory
from shoal.fleet.routing.policies import RouteRequest
from shoal.fleet.routing.prompt_keys import PromptKeys
from shoal.fleet.routing.tiers import TierConfig, TierRouter
from shoal.fleet.workload_trace import WorkloadTrace
from shoal.protocol import tracing
from shoal.protocol.bodies import parse_json_object
from shoal.protocol.disconnect import unless_client_leaves
from shoal.protocol.errors import APIError

# Bodies past this are parsed on a worker thread: a 4 MiB JSON body takes tens of milliseconds.
PARSE_INLINE_BYTES = 64 * 1024


async def _ended_with(body, span, status: int):
    """A stream's body that ends its request's span when it ends."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        tracing.end(span, status)


def completion_estimate(body: dict) -> int:
    """Completion tokens charged at admission: what the request may generate, corrected later."""
    cap = body.get("max_completion_tokens") or body.get("max_tokens")
    n = body.get("n") if isinstance(body.get("n"), int) and body.get("n", 0) > 0 else 1
    if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
        cap = DEFAULT_COMPLETION_ESTIMATE
    return min(cap, 1 << 20) * min(n, 128)


class Pipeline:
    def __init__(
        self,
        config: GatewayConfig,
        catalog: ModelCatalog,
        tenants: Tenants,
        keys: PromptKeys,
        tiers: TierRouter,
        dispatch: Dispatcher,
        proxy: Proxy,
        metrics: GatewayMetrics,
        adapters: AdapterDirectory,
        grounding: Grounding | None = None,
        trace: WorkloadTrace | None = None,
        shadow: Shadow | None = None,
    ):
        """`grounding`: the [[retrieval]] indexes chats may be grounded in (None: none). `trace`:
        where each request served is recorded for the simulator (None: nowhere). `shadow`: copies
        requests to a rolling update's new version (None: never)."""
        self.config = config
        self.catalog = catalog
        self.tenants = tenants
        self.keys = keys
        self.tiers = tiers
        self.dispatch = dispatch
        self.proxy = proxy
        self.metrics = metrics
        self.adapters = adapters
        self.grounding = grounding
        self.trace = trace
        self.shadow = shadow
        self.priority_base = min([0, *(t.config.priority for t in tenants.all.values())])

    async def forward(self, raw: Request, path: str) -> Response:
        """One client request, traced: its span (under the client's `traceparent`, if it sent one)
        ends when its answer, or its stream, does."""
        span = tracing.server_span(f"POST {path}", raw.headers, **{"http.route": path})
        token = context.attach(trace.set_span_in_context(span))
        try:
            resp = await self._forward(raw, path, span)
        except BaseException:
            tracing.end(span, 500)
            raise
        finally:
            context.detach(token)
        if isinstance(resp, StreamingResponse):
            resp.body_iterator = _ended_with(resp.body_iterator, span, resp.status_code)
        else:
            tracing.end(span, resp.status_code)
        return resp

    async def _forward(self, raw: Request, path: str, span) -> Response:
        tenant = priority = note = None
        try:
            tenant = self.authenticate(raw)
            data = await raw.body()
            if len(data) > PARSE_INLINE_BYTES:
                body = await asyncio.to_thread(parse_json_object, data)
            else:
                body = parse_json_object(data)
            if body.pop("kv_transfer_params", None) is not None:
                raise APIError(
                    400, "kv_transfer_params is set by the gateway, not by clients", "kv_transfer_params"
                )
            self.tenants.check_model(tenant, body.get("model"))
            priority = self.priority(tenant, body)
            if "retrieval" in body:
                body, note = await self._ground(path, body, tenant, priority)
            tier = self.tiers.get(body.get("model"))
            routed = {**body, "model": tier.cheap} if tier is not None else body
            route = await self.route_keys(path, routed, raw.headers)
            route.span = span
            span.set_attributes({"shoal.tenant": tenant.name, "shoal.model": str(body.get("model"))[:200]})
            tokens = route.tokens + completion_estimate(body)
            ticket = await self.tenants.admit_across(tenant, body.get("model"), tokens)
            self.metrics.tenant_requests.labels(tenant.name, "interactive").inc()
            over = self.dispatch.shares.over(tenant.name, route.model)
            if priority != self.priority_base or over or "priority" in body:
                body["priority"] = self.engine_priority(priority, over)  # others may not know it
            route.priority = priority
            headers = self.upstream_headers(raw)
            if tier is None:
                sent = self.send(path, body, headers, route, ticket, len(data), settle=True)
            else:
                sent = self.send_tiered(tier, path, body, raw.headers, headers, route, ticket, len(data))
            # Until its answer (or its stream) starts: after that, Starlette notices a client leaving.
            resp = await unless_client_leaves(raw.receive, sent)
        except APIError as exc:
            resp = exc.response()
        if note is not None:
            annotate(resp, note)
        if tenant is not None:
            resp.headers.update(tenant.rate_headers())
            if priority is not None:
                resp.headers["x-shoal-priority"] = str(priority)
        self.metrics.responses.labels(str(resp.status_code)).inc()
        return resp

    # --- the steps -----------------------------------------------------------------------

    def authenticate(self, raw: Request) -> Tenant:
        """The tenant whose key the request carries (401 for none or an unknown one)."""
        return self.tenants.authenticate(raw.headers.get("authorization", ""))

    def priority(self, tenant: Tenant, body: dict) -> int:
        """The gateway decides: the tenant's class, or lower when the client asks (a larger value)."""
        asked = body.get("priority")
        if self.config.trust_client_priority and isinstance(asked, int) and not isinstance(asked, bool):
            return asked
        return tenant.priority_for(asked)

    def engine_priority(self, cls: int, over_share: bool = False) -> int:
        """What the engine gets. Without tenants, the class as it is. With them, the gateway owns
        the scale: the class from 0 up (replicas keep clients' priorities at 0 or above), doubled
        so that a request past its tenant's fair share while another tenant wants some runs just
        after its class, and a tenant within its share has its prompt steps to itself in the
        engine (see the scheduler)."""
        if not self.config.tenants:
            return cls  # one tenant: no shares, and foreign backends see the client's number
        return 2 * (cls - self.priority_base) + int(over_share)

    async def route_keys(self, path: str, body: dict, headers) -> RouteRequest:
        """The model the request goes to (404 for one this fleet does not serve), the LoRA adapter
        over it that the request names, its session, and its prompt's keys."""
        session = headers.get(self.config.session_header) or body.get("user")
        session = session if isinstance(session, str) else None
        model = None
        name = body.get("model")
        entry = self.adapters.lookup(name)
        if entry is not None and not self.catalog.names_a_model(name):
            model = entry.model if self.catalog.multi_model else None
            await self.adapters.ensure_holder(name, model)
            return await self.keys.route(path, body, session, model, adapter=name)
        if self.catalog.multi_model:
            model = body.get("model")
            if not self.catalog.serves(model):
                names = ", ".join(m.name for m in self.catalog.models)
                raise APIError(
                    404,
                    f"the model {str(model)[:100]!r} does not exist; this fleet serves {names}",
                    "model",
                    "model_not_found",
                )
        return await self.keys.route(path, body, session, model)

    def upstream_headers(self, raw: Request | None = None) -> dict[str, str]:
        """The replica's key when the gateway has one; else the client's own passes through. The
        current trace context (the request's span) goes with them."""
        headers = {}
        if raw is not None:
            headers = {k: v for k in ("x-request-id", "content-type") if (v := raw.headers.get(k))}
            # One id for the request in the gateway's log, the replicas' and the client's answer.
            headers.setdefault("x-request-id", uuid.uuid4().hex)
        key = self.config.replica_key
        if key:
            headers["authorization"] = f"Bearer {key}"
        elif raw is not None and not self.config.tenants and (auth := raw.headers.get("authorization")):
            headers["authorization"] = auth  # a tenant's key is the gateway's to know, not a backend's
        return tracing.outgoing(headers)

    async def send(
        self, path: str, body: dict, headers: dict, route, ticket: Ticket, size: int, settle: bool
    ) -> Response:
        """One request to a replica of `route.model`, its tokens recorded on `ticket` (and the ticket
        settled when it ends, with `settle`: at the end of its stream, for a stream)."""
        route.tenant = ticket.tenant.name
        done = self._settle if settle else self._record
        fwd = Forward(path, body, headers, route, time.monotonic(), size, on_done=lambda f: done(ticket, f))
        if self.shadow is not None:
            self.shadow.copy(fwd)
        try:
            return await self.proxy.handle(fwd)
        except BaseException:
            fwd.settle()  # the proxy settles every request it answers; this one it could not
            raise

    async def send_tiered(
        self, tier: TierConfig, path, body, raw_headers, headers, route, ticket, size
    ) -> Response:
        first = True

        async def attempt(p: str, b: dict) -> Response:
            nonlocal first
            r = route
            if not first or b["model"] != tier.cheap:  # routed afresh for the other model
                r = await self.route_keys(p, b, raw_headers)
                r.priority = route.priority
            first = False
            return await self.send(p, b, headers, r, ticket, size, settle=bool(b.get("stream")))

        try:
            may = ticket.tenant.may_use(tier.strong)
            resp = await self.tiers.run(tier, path, body, raw_headers, route.tokens, attempt, may)
        except BaseException:
            ticket.settle()
            raise
        if not isinstance(resp, StreamingResponse):
            ticket.settle()  # a stream's ticket is settled when it ends
        return resp

    def _record(self, ticket: Ticket, fwd: Forward) -> None:
        prompt, completion = fwd.usage
        ticket.record(prompt, completion)
        self.dispatch.charge(ticket.tenant.name, completion)  # the prompt was charged at dispatch
        name, lane = ticket.tenant.name, ticket.lane
        self.metrics.tenant_tokens.labels(name, lane, "prompt").inc(prompt)
        self.metrics.tenant_tokens.labels(name, lane, "completion").inc(completion)

    def _settle(self, ticket: Ticket, fwd: Forward) -> None:
        self._record(ticket, fwd)
        if self.trace is not None:
            self.trace.record(fwd, ticket.tenant.name)
        ticket.settle()

    # --- retrieval ------------------------------------------------------------------------

    async def _ground(self, path: str, body: dict, tenant: Tenant, priority: int) -> tuple[dict, dict]:
        if self.grounding is None or not path.endswith("chat/completions"):
            message = "retrieval grounds chat completions, on a gateway with [[retrieval]] indexes"
            raise APIError(400, message, "retrieval")
        return await self.grounding.ground(body, self.embedder(tenant, priority))

    async def retrieve(self, raw: Request) -> dict:
        """POST /v1/retrieve: {"index", "input" (text) or "vector", "top_k", "model"}."""
        tenant = self.authenticate(raw)
        body = parse_json_object(await raw.body())
        if self.grounding is None:
            raise APIError(404, "this gateway has no [[retrieval]] indexes", "index")
        text = body.get("input")
        if text is not None and not isinstance(text, str):
            raise APIError(400, "input must be a string", "input")
        found = await self.grounding.retrieve(body, text, body.get("model"), self.embedder(tenant, 0))
        return {
            "object": "list",
            "index": body["index"],
            "data": [asdict(h) for h in found.hits],
            "partial": found.partial,
            "missed_shards": found.missed,
        }

    def embedder(self, tenant: Tenant, priority: int):
        """Embeds a query through the fleet, as the tenant's own request at `priority`."""

        async def embed(text: str, model: str | None) -> list[float]:
            body = {"model": model, "input": text}
            status, out = await self.run_internal("/v1/embeddings", body, tenant, priority)
            if status != 200:
                why = (out.get("error") or {}).get("message", "") if isinstance(out, dict) else ""
                message = f"embedding the query failed (HTTP {status}): {why}"
                raise APIError(502, message, code="retrieval_failed")
            return out["data"][0]["embedding"]

        return embed

    # --- the batch lane's requests -------------------------------------------------------

    async def run_internal(
        self, path: str, body: dict, tenant: Tenant, priority: int | None = None
    ) -> tuple[int, dict]:
        """One unstreamed request of the batch lane: after every interactive request waiting, and
        not held to the tenant's interactive limits; or, at an interactive `priority`, one that
        the gateway makes for a client's request (its query's embedding), admitted as the tenant's
        own. (status, JSON body) whatever happens."""
        batch = priority is None
        cls = self.config.batch_priority if batch else priority
        body = {**body, "stream": False, "priority": self.engine_priority(cls)}
        body.pop("kv_transfer_params", None)
        ticket = self.tenants.batch_ticket(tenant) if batch else None
        self.metrics.tenant_requests.labels(tenant.name, "batch" if batch else "interactive").inc()
        try:
            self.tenants.check_model(tenant, body.get("model"))
            route = await self.route_keys(path, body, {})
            route.priority = cls
            if ticket is None:
                ticket = await self.tenants.admit_across(tenant, body.get("model"), route.tokens)
            resp = await self.send(path, body, self.upstream_headers(), route, ticket, 0, settle=True)
        except APIError as exc:
            if ticket is not None:
                ticket.settle()
            return exc.status, exc.body()
        try:
            return resp.status_code, json.loads(resp.body)
        except ValueError:
            return 502, {"error": {"message": "the replica's answer was not JSON", "type": "server_error"}}
