"""The gateway: one OpenAI endpoint in front of many replicas."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from shoal.fleet.admission.canary import CanarySplit
from shoal.fleet.admission.dispatch import Dispatcher
from shoal.fleet.admission.fair_queue import FairQueue
from shoal.fleet.admission.shares import FairShares
from shoal.fleet.admission.signals import DemandSignals
from shoal.fleet.admission.tenants import DEFAULT_COMPLETION_ESTIMATE, Tenant, Tenants, Ticket
from shoal.fleet.admission.usage_store import UsageStore, state_dir
from shoal.fleet.batch.runner import BatchService
from shoal.fleet.catalog import ModelCatalog
from shoal.fleet.config import FleetConfig, GatewayConfig
from shoal.fleet.control.controller import FleetController
from shoal.fleet.control.launchers.base import Launcher
from shoal.fleet.control.launchers.local import LocalLauncher
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.proxy.proxy import Forward, Proxy
from shoal.fleet.replicas.health import HealthMonitor
from shoal.fleet.replicas.table import ReplicaTable
from shoal.fleet.routing.policies import RouteRequest, make_policy
from shoal.fleet.routing.prefix_index import PrefixIndex
from shoal.fleet.routing.tiers import TierRouter
from shoal.models.chat_template import template_message
from shoal.models.tokenizer import Tokenizer
from shoal.models.tool_formats import conversation, offered_tools, tool_format
from shoal.protocol.auth import bearer_matches
from shoal.protocol.block_hash import NONE_HASH, hash_blocks, root_hash
from shoal.protocol.bodies import parse_json_object
from shoal.protocol.errors import APIError
from shoal.protocol.secrets import kv_salt

log = logging.getLogger(__name__)

USAGE_WRITE_INTERVAL_S = 2.0
TEXT_BLOCK_BYTES = 64  # without the model's tokenizer, prompts are hashed in blocks of bytes
# Bodies past this are parsed on a worker thread: a 4 MiB JSON body takes tens of milliseconds.
PARSE_INLINE_BYTES = 64 * 1024


def _completion_estimate(body: dict) -> int:
    """Completion tokens charged at admission: what the request may generate, corrected later."""
    cap = body.get("max_completion_tokens") or body.get("max_tokens")
    n = body.get("n") if isinstance(body.get("n"), int) and body.get("n", 0) > 0 else 1
    if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
        cap = DEFAULT_COMPLETION_ESTIMATE
    return min(cap, 1 << 20) * min(n, 128)


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
    def __init__(
        self, config: GatewayConfig, fleet: FleetConfig | None = None, launcher: Launcher | None = None
    ):
        """A gateway over `config.backends`, or over the replicas of `fleet` (whose gateway config
        `config` is), which it runs through `launcher` (default: local processes)."""
        self.config = config
        self.catalog = ModelCatalog.of(fleet) if fleet is not None else ModelCatalog()
        self.metrics = GatewayMetrics()
        self.index = PrefixIndex()
        self.policy = make_policy(config.policy, self.index, config.load_weight, config.imbalance_limit)
        self.table = ReplicaTable(self.index, self.metrics, config.block_size)
        self.demand = DemandSignals()
        self.canary = CanarySplit()
        self.tenants = Tenants(config.tenants, config.api_key)
        self.tenants.on_limited = lambda t, limit: self.metrics.tenant_rate_limited.labels(
            t.name, limit
        ).inc()
        fair = FairQueue({t.name: t.config.weight for t in self.tenants.all.values()})
        shares = FairShares(config, self.tenants, self.table)
        self.dispatch = Dispatcher(
            config,
            self.table,
            self.policy,
            self.index,
            self.metrics,
            fair,
            shares,
            self.demand,
            self.canary,
            self.catalog.wakes,
        )
        self.health = HealthMonitor(config, self.table, self.index, self.metrics, self.dispatch.notify_nowait)
        self.controller: FleetController | None = None  # runs the replicas, when the fleet owns them
        if fleet is not None:
            self.controller = FleetController(
                fleet,
                launcher or LocalLauncher(),
                self.table,
                self.demand,
                self.canary,
                self.metrics,
                self.dispatch.notify_nowait,
            )
        self.tokenizer: Tokenizer | None = None
        self.proxy: Proxy | None = None
        self.kv_root = NONE_HASH
        self.priority_base = min([0, *(t.config.priority for t in self.tenants.all.values())])
        self.tiers = TierRouter(config.tiers, self.metrics)
        self.usage_store: UsageStore | None = None
        self.batches = BatchService(
            config, self.dispatch, self.tenants.all, self.run_internal, self.catalog.multi_model
        )
        for i, url in enumerate(config.backends):
            self.table.add(f"backend-{i}", url)

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

    def _route_hashes(self, path: str, body: dict) -> tuple[list[int], int]:
        """The prompt's block hashes and about how many tokens it has. Runs on a worker thread.
        A prompt too long for any context is not tokenized: the replica refuses it anyway, and
        tokenizing megabytes would hold a thread for seconds."""
        limit = self.config.route_tokenize_max_chars
        ids = None
        chars = _prompt_chars(path, body)
        if chars <= limit:
            try:
                ids = self._prompt_ids(path, body)
            except Exception:  # a prompt the template refuses: the replica will say why
                ids = None
        if ids is not None:
            return hash_blocks(ids[:limit], self.table.block_size, root=self.kv_root), len(ids)
        prompt = body.get("messages") or body.get("prompt") or ""
        if isinstance(prompt, str):
            text = prompt[:limit]
        else:
            text = json.dumps(prompt, sort_keys=True, ensure_ascii=False)[:limit]
        # About four characters a token, for admission's token estimate.
        return hash_blocks(list(text.encode("utf-8", "replace")), TEXT_BLOCK_BYTES), chars // 4

    async def route_request(self, path: str, body: dict, headers) -> RouteRequest:
        session = headers.get(self.config.session_header) or body.get("user")
        model = None
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
        hashes, tokens = await asyncio.to_thread(self._route_hashes, path, body)
        return RouteRequest(hashes, session if isinstance(session, str) else None, model=model, tokens=tokens)

    # --- requests ------------------------------------------------------------------------

    def check_key(self, raw: Request) -> Tenant:
        """The tenant whose key the request carries (401 for none or an unknown one)."""
        return self.tenants.authenticate(raw.headers.get("authorization", ""))

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

    def upstream_headers(self, raw: Request | None = None) -> dict[str, str]:
        """The replica's key when the gateway has one; else the client's own passes through."""
        headers = {}
        if raw is not None:
            headers = {k: v for k in ("x-request-id", "content-type") if (v := raw.headers.get(k))}
        key = self.config.replica_key
        if key:
            headers["authorization"] = f"Bearer {key}"
        elif raw is not None and not self.config.tenants and (auth := raw.headers.get("authorization")):
            headers["authorization"] = auth  # a tenant's key is the gateway's to know, not a backend's
        return headers

    def engine_priority(self, cls: int, over_share: bool = False) -> int:
        """What the engine gets. Without tenants, the class as it is. With them, the gateway owns
        the scale: the class from 0 up (replicas keep clients' priorities at 0 or above), doubled
        so that a request past its tenant's fair share while another tenant wants some runs just
        after its class, and a tenant within its share has its prompt steps to itself in the
        engine (see the scheduler)."""
        if not self.config.tenants:
            return cls  # one tenant: no shares, and foreign backends see the client's number
        return 2 * (cls - self.priority_base) + int(over_share)

    def priority(self, tenant: Tenant, body: dict) -> int:
        """The gateway decides: the tenant's class, or lower when the client asks (a larger value)."""
        asked = body.get("priority")
        if self.config.trust_client_priority and isinstance(asked, int) and not isinstance(asked, bool):
            return asked
        return tenant.priority_for(asked)

    async def forward(self, raw: Request, path: str) -> Response:
        tenant = priority = None
        try:
            tenant = self.check_key(raw)
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
            tier = self.tiers.get(body.get("model"))
            routed = {**body, "model": tier.cheap} if tier is not None else body
            route = await self.route_request(path, routed, raw.headers)
            ticket = self.tenants.admit(tenant, body.get("model"), route.tokens + _completion_estimate(body))
            self.metrics.tenant_requests.labels(tenant.name, "interactive").inc()
            over = self.dispatch.shares.over(tenant.name, route.model)
            if priority != self.priority_base or over or "priority" in body:
                body["priority"] = self.engine_priority(priority, over)  # others may not know it
            route.priority = priority
            headers = self.upstream_headers(raw)
            if tier is None:
                resp = await self.send(path, body, headers, route, ticket, len(data), settle=True)
            else:
                resp = await self.send_tiered(
                    tier, path, body, raw.headers, headers, route, ticket, len(data)
                )
        except APIError as exc:
            resp = exc.response()
        if tenant is not None:
            resp.headers.update(tenant.rate_headers())
            if priority is not None:
                resp.headers["x-shoal-priority"] = str(priority)
        self.metrics.responses.labels(str(resp.status_code)).inc()
        return resp

    async def send(
        self, path: str, body: dict, headers: dict, route, ticket: Ticket, size: int, settle: bool
    ) -> Response:
        """One request to a replica of `route.model`, its tokens recorded on `ticket` (and the ticket
        settled when it ends, with `settle`: at the end of its stream, for a stream)."""
        route.tenant = ticket.tenant.name
        done = self._settle if settle else self._record
        fwd = Forward(path, body, headers, route, time.monotonic(), size, on_done=lambda f: done(ticket, f))
        try:
            return await self.proxy.handle(fwd)
        except BaseException:
            fwd.settle()  # the proxy settles every request it answers; this one it could not
            raise

    async def send_tiered(self, tier, path, body, raw_headers, headers, route, ticket, size) -> Response:
        first = True

        async def attempt(p: str, b: dict) -> Response:
            nonlocal first
            r = route
            if not first or b["model"] != tier.cheap:  # routed afresh for the other model
                r = await self.route_request(p, b, raw_headers)
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
        ticket.settle()

    async def run_internal(self, path: str, body: dict, tenant: Tenant) -> tuple[int, dict]:
        """One unstreamed request of the batch lane: after every interactive request waiting, and
        not held to the tenant's interactive limits. (status, JSON body) whatever happens."""
        cls = self.config.batch_priority
        body = {**body, "stream": False, "priority": self.engine_priority(cls)}
        body.pop("kv_transfer_params", None)
        ticket = self.tenants.batch_ticket(tenant)
        self.metrics.tenant_requests.labels(tenant.name, "batch").inc()
        try:
            self.tenants.check_model(tenant, body.get("model"))
            route = await self.route_request(path, body, {})
            route.priority = cls
            resp = await self.send(path, body, self.upstream_headers(), route, ticket, 0, settle=True)
        except APIError as exc:
            ticket.settle()
            return exc.status, exc.body()
        try:
            return resp.status_code, json.loads(resp.body)
        except ValueError:
            return 502, {"error": {"message": "the replica's answer was not JSON", "type": "server_error"}}

    async def list_models(self, raw: Request, tenant: Tenant) -> dict[str, Any]:
        ready = self.table.ready()
        headers = self.upstream_headers(raw)
        answers = await asyncio.gather(
            *(self.proxy.client.get(r.url + "/v1/models", headers=headers, timeout=5) for r in ready),
            return_exceptions=True,
        )
        cards: dict[str, Any] = {}
        if self.catalog.multi_model:  # also those scaled to zero
            for m in self.catalog.models:
                cards[m.name] = {"id": m.name, "object": "model", "created": 0, "owned_by": "shoal"}
        for a in answers:
            if not isinstance(a, BaseException) and a.status_code == 200:
                with contextlib.suppress(ValueError, AttributeError, KeyError, TypeError):
                    for card in a.json().get("data", []):
                        cards.setdefault(card["id"], card)
        for t in self.tiers.routes:
            cards[t] = {"id": t, "object": "model", "created": 0, "owned_by": "shoal"}
        return {"object": "list", "data": [c for c in cards.values() if tenant.may_use(c["id"])]}

    def usage(self) -> dict[str, Any]:
        """Usage totals by tenant and lane: stored ones and this process's."""
        counts = self.tenants.counts()
        totals = self.usage_store.totals(counts) if self.usage_store is not None else counts
        out: dict[str, dict] = {}
        for (tenant, lane), u in sorted(totals.items()):
            out.setdefault(tenant, {})[lane] = u.as_dict()
        return {"object": "list", "tenants": out}

    async def _write_usage(self) -> None:
        while True:
            await asyncio.sleep(USAGE_WRITE_INTERVAL_S)
            try:
                await asyncio.to_thread(self.usage_store.write, self.tenants.counts())
            except Exception:  # a full disk must not stop the gateway; the next write retries
                log.exception("could not write usage totals")

    # --- app -----------------------------------------------------------------------------

    def build_app(self) -> FastAPI:
        from shoal.fleet.routes import build_app

        return build_app(self)

    async def start(self) -> None:
        where = state_dir(self.config.state_dir, self.config.port)
        if where is None:
            where = Path(tempfile.mkdtemp(prefix="shoal-gateway-"))
            log.warning("no cache directory: batch jobs and usage live in %s only", where)
        where.mkdir(parents=True, exist_ok=True)
        self.config.state_dir = str(where)
        self.usage_store = await asyncio.to_thread(UsageStore, where / "usage.sqlite3")
        self._usage_task = asyncio.get_running_loop().create_task(self._write_usage())
        self.kv_root = root_hash(kv_salt(self.config.kv_salt, self.config.replica_key))
        self.proxy = Proxy(
            self.config, self.table, self.health, self.dispatch, self.demand, self.metrics, self.kv_root
        )
        if self.controller is not None:
            await self.controller.start()
        await self.health.start()
        try:
            from shoal.models.checkpoint import load_tokenizer

            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer)
        except Exception as exc:  # a foreign model: route on text blocks instead
            log.warning("no tokenizer for prefix routing (%s); hashing prompt text instead", exc)
        await self.batches.start()

    async def stop(self) -> None:
        await self.batches.stop()
        self._usage_task.cancel()
        await asyncio.to_thread(self.usage_store.write, self.tenants.counts())
        self.usage_store.close()
        if self.controller is not None:
            await self.controller.stop()
        await self.health.stop()
        if self.proxy is not None:
            await self.proxy.aclose()
