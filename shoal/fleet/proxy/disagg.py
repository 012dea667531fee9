"""Prefill/decode disaggregation in the gateway. Once the decode worker for a request is chosen
(by load and KV usage, like any replica), the prompt is either prefilled there (short, mostly
cached there, or a request the split does not carry) or sent first to a prefill worker (chosen by
KV locality and load), whose answer names the K/V it holds; the decode worker then pulls that K/V
and generates. The client sees the decode worker's one stream, id and usage.

A prefill that fails, stalls past `prefill_timeout_s` or is refused leaves the prompt to the
decode worker: slower, never a failed request. A prefill worker that died under the request is
judged like any replica death (see FailureJudge.judge_death), so a poison prompt does not go on to kill
the decode worker too."""

from __future__ import annotations

import json
import logging
import time

import httpx
from prometheus_client import Counter, Histogram

from shoal.fleet.admission.dispatch import Dispatcher, NoReplicaError, ReplicaLease
from shoal.fleet.config import GatewayConfig
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.proxy.failure import FailureJudge
from shoal.fleet.proxy.forward import Forward
from shoal.fleet.proxy.upstream import Attempt, UpstreamClient
from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.replica import PREFILL_ROLES, Replica
from shoal.fleet.replicas.table import ReplicaTable
from shoal.protocol import tracing
from shoal.protocol.bodies import STRUCTURED_FIELDS
from shoal.protocol.errors import APIError
from shoal.protocol.metric_names import LATENCY_BUCKETS
from shoal.protocol.resume import RESUME_FIELD
from shoal.protocol.secrets import KV_TRANSFER_KEY_HEADER

log = logging.getLogger(__name__)

PATHS = ("/v1/completions", "/v1/chat/completions")
# Fields that shape the output, not the prompt: a prefill computes the prompt and one token.
OUTPUT_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "allowed_token_ids",
    "return_token_ids",
    *STRUCTURED_FIELDS,
)


def peer_params(source: Replica) -> dict:
    """kv_transfer_params that fetch a prompt's prefix from `source` (over shared memory when the
    receiver finds its probe: one host)."""
    host = source.load.get("kv_host")
    return {"source": source.url, "prefix": True, **({"host": host} if isinstance(host, str) else {})}


def prefill_body(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in OUTPUT_FIELDS}
    out.update(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})
    return out


class Disaggregator:
    """The P/D decider: where each request's prompt is computed. A swappable part: the relays
    only ask it for the body and headers to send to the decode worker they chose."""

    def __init__(
        self,
        config: GatewayConfig,
        table: ReplicaTable,
        index: PrefixIndex,
        dispatch: Dispatcher,
        client: UpstreamClient,
        judge: FailureJudge,
        metrics: GatewayMetrics,
    ):
        self.config = config
        self.table = table
        self.index = index  # who holds which blocks: a peer to fetch a prefix from
        self.dispatch = dispatch
        self.client = client
        self.judge = judge
        r = metrics.registry
        self.decisions = Counter(
            "shoal:gateway_disagg_decisions",
            "Where each request's prompt was computed: remote (a prefill worker), or local on the "
            "decode worker and why (short, cached, unsupported, no_prefill_worker, prefill_failed); "
            "peer_fetch: its prefix fetched from a replica holding it.",
            ["decision"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "shoal:gateway_prefill_seconds",
            "Time of the remote prefill step (queue, prompt and first token on the prefill worker).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    async def with_prefill(
        self, fwd: Forward, replica: Replica, body: dict, headers: dict, seen: dict
    ) -> tuple[dict, dict]:
        """The body and headers of the request to `replica`, after a remote prefill where one pays
        (decided once per request; a retry pulls the same K/V, or prefills itself if it is gone)."""
        if fwd.kv is None:  # should this raise, the caller gives `replica` back
            fwd.kv = await self.prefill(fwd, replica, seen) or {}
        if not fwd.kv:
            return body, headers
        return {**body, "kv_transfer_params": fwd.kv}, self.headers(headers)

    @property
    def active(self) -> bool:
        return self.table.has_role(PREFILL_ROLES)

    def headers(self, headers: dict) -> dict:
        return {**headers, KV_TRANSFER_KEY_HEADER: self.config.kv_transfer_key or ""}

    def _unsupported(self, fwd: Forward) -> bool:
        """Requests whose prompt is computed where they run: resumed, echoed, several prompts."""
        body = fwd.body
        prompt = body.get("prompt")
        several = isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list)
        return (
            fwd.path not in PATHS
            or body.get(RESUME_FIELD) is not None
            or body.get("echo")  # the prompt's logprobs are computed where the prompt is
            or body.get("max_tokens") == 0
            or several
            or not self.config.kv_transfer_key
        )

    def _local_reason(self, fwd: Forward, decode: Replica) -> str | None:
        route = fwd.route
        if self._unsupported(fwd):
            return "unsupported"
        if decode.role not in ("decode", "both"):
            return "no_decode_worker"  # a prefill worker standing in for a missing decode worker
        block, threshold = self.table.block_size, self.config.disagg_min_prompt_tokens
        total = len(route.hashes) * block  # full blocks only: a bound from below
        if route.hashes and route.cached_blocks == len(route.hashes):
            return "cached"
        if total - route.cached_blocks * block < threshold:
            return "cached" if total >= threshold else "short"
        return None

    async def prefill(self, fwd: Forward, decode: Replica, seen: dict) -> dict | None:
        """kv_transfer_params for the decode worker's request, or None: it prefills itself."""
        if not self.active or fwd.path not in PATHS:
            return self.peer_fetch(fwd, decode)
        reason = self._local_reason(fwd, decode)
        if reason is not None:
            return self._local(reason) or self.peer_fetch(fwd, decode)
        try:
            lease = await self.dispatch.lease(
                fwd.route, set(), roles=PREFILL_ROLES, timeout=self.config.prefill_timeout_s, only_roles=True
            )
        except NoReplicaError:
            return self._local("no_prefill_worker")
        t0 = time.monotonic()
        replica = lease.replica
        attempt = Attempt(replica)
        try:
            with (
                lease.held_until_given_back(),
                tracing.child("gateway.prefill", fwd.route.span, **{"shoal.replica": replica.name}) as span,
            ):
                params = await self._run(fwd, attempt, lease, seen)
                span.set_attribute("shoal.prefilled", params is not None)
        finally:
            attempt.done()
        if params is None:
            return self._local("prefill_failed")
        self.prefill_seconds.observe(time.monotonic() - t0)
        self.decisions.labels("remote").inc()
        return {"source": replica.url, "handle": params["handle"], "host": params.get("host")}

    def peer_fetch(self, fwd: Forward, decode: Replica) -> dict | None:
        """kv_transfer_params that fetch the prompt's prefix from the replica holding the most of
        it (its own KV events say so), when that is `peer_fetch_min_tokens` more than `decode`
        holds: loading blocks over the transport costs a fraction of computing them."""
        route, threshold = fwd.route, self.config.peer_fetch_min_tokens
        if not threshold or not route.hashes or self._unsupported(fwd):
            return None
        now = time.monotonic()
        peers = [r for r in self.table.serving(route.model, now) if r is not decode and r.kv_events]
        if not peers:
            return None
        matched = self.index.matched_blocks(route.hashes, [r.name for r in peers])
        best = max(peers, key=lambda r: matched[r.name])
        if (matched[best.name] - route.cached_blocks) * self.table.block_size < threshold:
            return None
        self.decisions.labels("peer_fetch").inc()
        return peer_params(best)

    def _local(self, reason: str) -> None:
        self.decisions.labels(f"local_{reason}").inc()
        return None

    async def _run(self, fwd: Forward, attempt: Attempt, lease: ReplicaLease, seen: dict) -> dict | None:
        replica = attempt.replica
        content = json.dumps(prefill_body(fwd.body), ensure_ascii=False).encode()
        # The prefill worker's spans go under this one (the current span: gateway.prefill).
        headers, timeout = tracing.outgoing(self.headers(fwd.headers)), self.config.prefill_timeout_s
        try:
            resp, data = await self.client.exchange(attempt, fwd.path, content, headers, timeout)
        except (httpx.HTTPError, TimeoutError) as exc:
            outcome = attempt.outcome(exc)
            timeout = outcome.kind == "timeout"
            lease.give_back(None if timeout else False, f"prefill: {outcome.message}")
            log.warning("prefill on %s failed (%s); prefilling on decode", replica.name, outcome.message)
            if outcome.is_death and await self.judge.judge_death(fwd, attempt, outcome, seen) == "poison":
                message = f"this request took replica {replica.name} down"
                raise APIError(500, message, code="poison_request") from None
            return None
        lease.give_back(resp.status_code < 500, f"prefill: HTTP {resp.status_code}")
        if resp.status_code != 200:
            log.warning("prefill on %s answered %d; prefilling on decode", replica.name, resp.status_code)
            return None
        try:
            params = json.loads(data)["kv_transfer_params"]
            if isinstance(params.get("handle"), str):
                return params
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
        log.warning("prefill on %s named no K/V; prefilling on decode", replica.name)
        return None
