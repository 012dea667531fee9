"""Forwards OpenAI requests to replicas: retries where the request provably did not run (or the
replica said so), continuation of streams after the first byte, no second replica for poison.

Timeouts: `first_byte_timeout_s` for a stream's headers and first event, `stream_idle_timeout_s`
between events, `request_timeout_s` for the whole of a non-streamed request. A timeout on a
replica that still passes probes is not held against it, and a non-streamed request that timed
out is not run again (it may still be running). A replica marked down (probe failure) interrupts
its requests at once: streams continue elsewhere, non-streamed requests run again elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shoal.fleet.config import GatewayConfig
from shoal.fleet.disagg import Disaggregator
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.poison import PoisonGuard, fingerprint, poison_error
from shoal.fleet.policies import RouteRequest
from shoal.fleet.registry import NoReplicaError, Registry
from shoal.fleet.replica import Replica
from shoal.fleet.upstream import Attempt, Outcome, error_outcome
from shoal.protocol.errors import APIError, error_body

log = logging.getLogger(__name__)

# Headers that describe one hop, not the message.
HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
    "server",
    "date",
}
ENCODE_INLINE_BYTES = 64 * 1024  # larger bodies are serialized (and fingerprinted) on a thread


@dataclass
class Forward:
    path: str
    body: dict
    headers: dict[str, str]
    route: RouteRequest
    started: float
    size: int = 0  # bytes of the client's body
    fp: str | None = field(default=None, repr=False)  # fingerprint, computed when needed
    kv: dict | None = None  # kv_transfer_params from a remote prefill ({}: prefilled on decode)
    usage: tuple[int, int] = (0, 0)  # (prompt, completion) tokens the answer reported
    on_done: Callable[[Forward], None] | None = field(default=None, repr=False)

    def settle(self) -> None:
        """Tells admission the request has ended (once), with the tokens it used."""
        done, self.on_done = self.on_done, None
        if done is not None:
            done(self)


def unavailable(message: str) -> JSONResponse:
    return JSONResponse(
        error_body(503, message, code="no_replica"), status_code=503, headers={"Retry-After": "1"}
    )


def passthrough(resp: httpx.Response, content: bytes) -> Response:
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
    return Response(content, status_code=resp.status_code, headers=headers)


def _json_or_none(content: bytes):
    try:
        return json.loads(content)
    except ValueError:
        return None


def usage_of(obj) -> tuple[int, int]:
    """(prompt, completion) tokens an OpenAI answer reports; (0, 0) when it reports none."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (p if isinstance(p, int) else 0), (c if isinstance(c, int) else 0)


class Proxy:
    def __init__(self, config: GatewayConfig, registry: Registry, metrics: GatewayMetrics):
        self.config = config
        self.registry = registry
        self.metrics = metrics
        key = config.replica_key
        # Deadlines are the attempt's own (see Attempt.deadline); httpx only bounds connecting.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=config.connect_timeout_s, pool=config.queue_timeout_s),
            limits=httpx.Limits(max_connections=2000, max_keepalive_connections=500),
            headers={"authorization": f"Bearer {key}"} if key else None,
        )
        self.guard = PoisonGuard(config.poison_ttl_s)
        self._retry_tokens = 3.0
        self.disagg = Disaggregator(self)

    async def aclose(self) -> None:
        await self.client.aclose()

    def may_retry(self, reason: str) -> bool:
        # A retry budget: each request earns a fraction of a retry, so a sick fleet is not hammered.
        if self._retry_tokens < 1:
            return False
        self._retry_tokens -= 1
        self.metrics.retries.labels(reason).inc()
        return True

    def wants_token_ids(self, replica: Replica) -> bool:
        return replica.kv_events  # a shoal replica: it can return token ids for continuation

    async def fingerprint(self, fwd: Forward) -> str:
        if fwd.fp is None:
            if fwd.size > ENCODE_INLINE_BYTES:
                fwd.fp = await asyncio.to_thread(fingerprint, fwd.path, fwd.body)
            else:
                fwd.fp = fingerprint(fwd.path, fwd.body)
        return fwd.fp

    async def encode(self, body: dict, size: int) -> bytes:
        if size > ENCODE_INLINE_BYTES:
            return await asyncio.to_thread(lambda: json.dumps(body, ensure_ascii=False).encode())
        return json.dumps(body, ensure_ascii=False).encode()

    async def with_prefill(
        self, fwd: Forward, replica: Replica, body: dict, headers: dict, seen: dict
    ) -> tuple[dict, dict]:
        """The body and headers of the request to `replica`, after a remote prefill where one pays
        (decided once per request; a retry pulls the same K/V, or prefills itself if it is gone)."""
        if fwd.kv is None:
            try:
                fwd.kv = await self.disagg.prefill(fwd, replica, seen) or {}
            except BaseException:
                await self.registry.release(replica, None)
                raise
        if not fwd.kv:
            return body, headers
        return {**body, "kv_transfer_params": fwd.kv}, self.disagg.headers(headers)

    async def exchange(
        self, attempt: Attempt, path: str, content: bytes, headers: dict, timeout: float
    ) -> tuple[httpx.Response, bytes]:
        """One unstreamed request on the attempt's replica, within `timeout`: response and body."""
        async with attempt.deadline(timeout):
            resp = await self.send(attempt.replica, path, content, headers)
            try:
                return resp, await resp.aread()
            finally:
                await resp.aclose()

    async def send(self, replica: Replica, path: str, content: bytes, headers: dict) -> httpx.Response:
        req = self.client.build_request(
            "POST",
            replica.url + path,
            content=content,
            headers={**headers, "content-type": "application/json"},
        )
        return await self.client.send(req, stream=True)

    async def judge_death(self, fwd: Forward, attempt: Attempt, outcome: Outcome, seen: dict) -> str:
        """After an attempt ended with its replica possibly dead: "retry" (the replica is fine, or
        the request came after the death), "continue" (struck once), or "poison". `seen` maps the
        deaths already judged for this request to their verdict: one verdict per death."""
        r = attempt.replica
        if outcome.kind == "engine_dead":
            # Marked down now, so its other requests fail over at once; they learn from the
            # death record that it was a crash, whichever of them hears of it first.
            self.registry.mark_down(r.name, f"engine died: {outcome.message}")
            death = r.death
            death.engine_dead = True
        elif outcome.kind == "interrupted":
            death = r.death
        else:
            death = await self.registry.fate(r)
        if death is None:
            return "retry"
        key = id(death)
        if key not in seen:
            if death.suspects and attempt not in death.suspects:
                seen[key] = "retry"  # it reached a replica that was already dead
            else:
                fp = await self.fingerprint(fwd)
                poison = self.guard.judge(fp, death, attempt, outcome.kind == "engine_dead")
                seen[key] = "poison" if poison else "continue"
                if poison:
                    self.metrics.poison.inc()
                    log.warning("poison request %s: %s died under it (%s)", fp[:12], r.name, death.reason)
        return seen[key]

    # --- requests ------------------------------------------------------------------------

    async def handle(self, fwd: Forward) -> Response:
        self._retry_tokens = min(10.0, self._retry_tokens + self.config.retry_budget)
        if self.guard.active:
            left = self.guard.refused(await self.fingerprint(fwd))
            if left:
                self.metrics.e2e.observe(time.monotonic() - fwd.started)
                fwd.settle()
                return poison_error(
                    f"this request took a replica down; identical requests are refused for {left:.0f} s"
                ).response()
        if fwd.body.get("stream") is True:
            from shoal.fleet.relay import Relay  # relay imports this module

            resp = await Relay(self, fwd).start()
            if not isinstance(resp, StreamingResponse):
                fwd.settle()  # it never streamed; else the stream settles when it ends
            return resp
        try:
            return await self._unary(fwd)
        finally:
            self.metrics.e2e.observe(time.monotonic() - fwd.started)
            fwd.settle()

    async def _unary(self, fwd: Forward) -> Response:
        cfg = self.config
        tried: set[str] = set()
        seen: dict = {}
        last: Response | None = None
        content_out = await self.encode(fwd.body, fwd.size)
        for attempt_no in range(cfg.max_retries + 1):
            can_retry = attempt_no < cfg.max_retries
            try:
                replica = await self.registry.acquire(fwd.route, tried)
            except NoReplicaError as exc:
                if last is None:
                    self.metrics.rejections.inc()
                    last = unavailable(str(exc))
                break
            tried.add(replica.name)
            body, headers = await self.with_prefill(fwd, replica, fwd.body, fwd.headers, seen)
            content = content_out if body is fwd.body else await self.encode(body, fwd.size)
            attempt = Attempt(replica)
            try:
                out = await self._try_unary(fwd, attempt, content, headers, seen)
            finally:
                attempt.done()  # only now: a death judged above must count it among its suspects
            if isinstance(out, Response):
                return out
            retry, last = out
            if not can_retry:
                break
            if retry in ("interrupted", "dropped", "engine_dead"):
                # Its replica died: running it once more is the continuation the poison rule allows.
                self.metrics.retries.labels(retry).inc()
            elif not self.may_retry(retry):
                break
        return last or unavailable("no replica could serve the request")

    async def _try_unary(
        self, fwd: Forward, attempt: Attempt, content_out: bytes, headers: dict, seen: dict
    ) -> Response | tuple[str | None, Response]:
        """One attempt: the client's response, or (why to retry or None, the response so far)."""
        cfg = self.config
        replica = attempt.replica
        try:
            resp, content = await self.exchange(
                attempt, fwd.path, content_out, headers, cfg.request_timeout_s
            )
        except (httpx.HTTPError, TimeoutError) as exc:
            outcome = attempt.outcome(exc)
            if outcome.kind == "timeout":
                await self.registry.release(replica, None, failed=True)  # slow, not sick: not held against it
                return APIError(
                    504,
                    f"replica {replica.name} did not answer within {cfg.request_timeout_s:.0f} s; "
                    "the request was not sent elsewhere (it may still be running)",
                    code="timeout",
                ).response()
            await self.registry.release(replica, False, outcome.message)
            last = unavailable(f"replica {replica.name} failed: {outcome.message}")
            if outcome.kind == "not_sent":
                return "connect", last
            verdict = await self.judge_death(fwd, attempt, outcome, seen)
            if verdict == "poison":
                return poison_error(f"this request took replica {replica.name} down").response()
            return outcome.kind, last
        if resp.status_code >= 500:
            answer = await self._replica_error(fwd, attempt, resp, content, seen)
            if isinstance(answer, Response):
                return answer
            return answer, passthrough(resp, content)
        await self.registry.release(replica, True)  # 4xx is the client's doing, not the replica's
        if resp.status_code < 300:
            fwd.usage = usage_of(_json_or_none(content))
        out = passthrough(resp, content)
        out.headers["x-replica"] = replica.name
        return out

    async def _replica_error(
        self, fwd: Forward, attempt: Attempt, resp, content: bytes, seen: dict
    ) -> Response | str:
        """A 5xx answer: the response to give the client, or why to retry it elsewhere."""
        replica = attempt.replica
        outcome = error_outcome(_json_or_none(content))
        if outcome.kind == "internal_error" and resp.status_code == 500:
            # The engine failed this request alone and went on: it would fail anywhere.
            await self.registry.release(replica, True, failed=True)
            self.guard.strike(await self.fingerprint(fwd))
            return passthrough(resp, content)
        if outcome.kind == "engine_dead":
            await self.registry.release(replica, False, f"HTTP {resp.status_code}: {outcome.message}")
            verdict = await self.judge_death(fwd, attempt, outcome, seen)
            if verdict == "poison":
                return poison_error(f"this request took replica {replica.name} down").response()
            return "engine_dead"
        # A 503 is a busy replica shedding load: try another, but it is not sick.
        await self.registry.release(replica, resp.status_code == 503, f"HTTP {resp.status_code}", failed=True)
        return f"http_{resp.status_code}"
