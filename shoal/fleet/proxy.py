"""Forwards OpenAI requests to replicas: retries before the first byte, continuation after it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shoal.fleet.config import GatewayConfig
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.policies import RouteRequest
from shoal.fleet.registry import NoReplicaError, Registry
from shoal.fleet.replica import Replica
from shoal.fleet.stream_state import StreamState
from shoal.protocol.block_hash import hash_blocks
from shoal.protocol.errors import error_body

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


class UpstreamBroken(Exception):
    """A replica failed mid-stream (connection lost, in-band error, or no [DONE])."""


@dataclass
class Forward:
    path: str
    body: dict
    headers: dict[str, str]
    route: RouteRequest
    started: float
    size: int = 0  # bytes of the client's body


def _unavailable(message: str) -> JSONResponse:
    return JSONResponse(
        error_body(503, message, code="no_replica"), status_code=503, headers={"Retry-After": "1"}
    )


def _sse_error(status: int, message: str) -> str:
    return f"data: {json.dumps(error_body(status, message))}\n\ndata: [DONE]\n\n"


async def _sse_data(resp: httpx.Response) -> AsyncIterator[str]:
    async for line in resp.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


class Proxy:
    def __init__(self, config: GatewayConfig, registry: Registry, metrics: GatewayMetrics):
        self.config = config
        self.registry = registry
        self.metrics = metrics
        key = config.replica_key
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.first_byte_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=2000, max_keepalive_connections=500),
            headers={"authorization": f"Bearer {key}"} if key else None,
        )
        self._retry_tokens = 3.0

    async def aclose(self) -> None:
        await self.client.aclose()

    def _may_retry(self, reason: str) -> bool:
        # A retry budget: each request earns a fraction of a retry, so a sick fleet is not hammered.
        if self._retry_tokens < 1:
            return False
        self._retry_tokens -= 1
        self.metrics.retries.labels(reason).inc()
        return True

    def _wants_token_ids(self, replica: Replica) -> bool:
        return replica.kv_events  # a shoal replica: it can return token ids for continuation

    async def _open(
        self, replica: Replica, path: str, body: dict, headers: dict, stream: bool
    ) -> httpx.Response:
        req = self.client.build_request("POST", replica.url + path, json=body, headers=headers)
        return await self.client.send(req, stream=stream)

    async def handle(self, fwd: Forward) -> Response:
        self._retry_tokens = min(10.0, self._retry_tokens + self.config.retry_budget)
        stream = bool(fwd.body.get("stream"))
        tried: set[str] = set()
        last: Response | None = None
        for attempt in range(self.config.max_retries + 1):
            try:
                replica = await self.registry.acquire(fwd.route, tried)
            except NoReplicaError as exc:
                if last is None:
                    self.metrics.rejections.inc()
                    last = _unavailable(str(exc))
                break
            tried.add(replica.name)
            body = dict(fwd.body)
            if stream and self._wants_token_ids(replica):
                body["return_token_ids"] = True
            try:
                resp = await self._open(replica, fwd.path, body, fwd.headers, stream=True)
                if not stream or resp.status_code != 200:  # a body to pass on or retry, never relayed
                    content = await resp.aread()
                    await resp.aclose()
            except httpx.HTTPError as exc:
                await self.registry.release(replica, False, f"{type(exc).__name__} before the first byte")
                last = _unavailable(f"replica {replica.name} failed: {type(exc).__name__}")
                if attempt < self.config.max_retries and self._may_retry("connect"):
                    continue
                break
            if resp.status_code >= 500:
                # A 503 is a busy replica shedding load: try another, but it is not sick.
                busy = resp.status_code == 503
                await self.registry.release(replica, busy, f"HTTP {resp.status_code}")
                last = self._passthrough(resp, content)
                if attempt < self.config.max_retries and self._may_retry(f"http_{resp.status_code}"):
                    continue
                break
            if not stream or resp.status_code != 200:
                await self.registry.release(replica, True)  # 4xx is the client's doing, not the replica's
                self.metrics.e2e.observe(time.monotonic() - fwd.started)
                out = self._passthrough(resp, content)
                out.headers["x-replica"] = replica.name
                return out
            state = StreamState(
                chat=fwd.path.endswith("chat/completions"),
                body=fwd.body,
                client_wants_ids=bool(fwd.body.get("return_token_ids")),
            )
            return StreamingResponse(
                self._relay(fwd, replica, resp, state, tried),
                media_type="text/event-stream",
                headers={
                    "x-replica": replica.name,
                    **({"x-request-id": rid} if (rid := resp.headers.get("x-request-id")) else {}),
                },
            )
        self.metrics.e2e.observe(time.monotonic() - fwd.started)
        return last or _unavailable("no replica could serve the request")

    def _passthrough(self, resp: httpx.Response, content: bytes) -> Response:
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        return Response(content, status_code=resp.status_code, headers=headers)

    async def _relay(
        self, fwd: Forward, replica: Replica, resp: httpx.Response, state: StreamState, tried: set[str]
    ) -> AsyncIterator[str]:
        first = True
        try:
            while True:
                try:
                    done = False
                    async for data in _sse_data(resp):
                        if data == "[DONE]":
                            done = True
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            raise UpstreamBroken(obj["error"].get("message", "in-band error"))
                        out = state.relay(obj)
                        if first:
                            self.metrics.ttft.observe(time.monotonic() - fwd.started)
                            first = False
                        yield f"data: {json.dumps(out, ensure_ascii=False)}\n\n"
                    if not done:
                        raise UpstreamBroken("the stream ended without [DONE]")
                    await self.registry.release(replica, True)
                    replica = None
                    yield "data: [DONE]\n\n"
                    return
                except (httpx.HTTPError, UpstreamBroken, json.JSONDecodeError) as exc:
                    await resp.aclose()
                    await self.registry.release(replica, False, f"mid-stream: {type(exc).__name__}: {exc}")
                    replica = None
                    log.warning("stream broke after %d chunks: %s", state.chunks, exc)
                    if not state.can_continue:
                        yield _sse_error(502, f"the replica failed mid-stream: {exc}")
                        return
                    replica, resp = await self._continue(fwd, state, tried)
                    if replica is None:
                        yield _sse_error(503, "no replica left to continue the stream")
                        return
                    self.metrics.failovers.inc()
        finally:
            if replica is not None:  # the client went away mid-stream
                await resp.aclose()
                await self.registry.release(replica, True)
            self.metrics.e2e.observe(time.monotonic() - fwd.started)

    async def _continue(self, fwd: Forward, state: StreamState, tried: set[str]):
        """Opens the rest of the stream on another replica: the original request when nothing was
        streamed yet, else a completion of prompt + streamed tokens."""
        for _ in range(self.config.max_retries + 1):
            if state.chunks == 0:
                route, path, body = fwd.route, fwd.path, dict(fwd.body)
            else:
                ids = state.prompt_ids + state.ids
                route = RouteRequest(hash_blocks(ids, self.registry.block_size), fwd.route.session)
                path, body = "/v1/completions", state.continuation_body()
            try:
                replica = await self.registry.acquire(route, tried)
            except NoReplicaError:
                return None, None
            tried.add(replica.name)
            if state.chunks == 0 and self._wants_token_ids(replica):
                body["return_token_ids"] = True
            try:
                pending = await self._held_back_text(replica, state) if state.chunks else ""
                resp = await self._open(replica, path, body, fwd.headers, stream=True)
            except httpx.HTTPError as exc:
                await self.registry.release(replica, False, f"continuation: {type(exc).__name__}")
                continue
            if resp.status_code != 200:
                await resp.aread()
                await resp.aclose()
                await self.registry.release(
                    replica, resp.status_code < 500, f"continuation: HTTP {resp.status_code}"
                )
                continue
            if state.chunks:
                state.begin_continuation(pending)
            return replica, resp
        return None, None

    async def _held_back_text(self, replica: Replica, state: StreamState) -> str:
        """Text of the streamed tokens that the failed replica had not sent yet (an incomplete
        character at the cut), so the client's text stays whole."""
        r = await self.client.post(
            replica.url + "/detokenize", json={"tokens": state.ids, "skip_special_tokens": True}, timeout=5
        )
        full = r.json().get("prompt", "") if r.status_code == 200 else ""
        return full[len(state.text) :] if full.startswith(state.text) else ""
