"""The pieces of a relayed stream (stream_relay.py): an upstream it reads, the error that ends
it, the response that cleans up after it, a prompt's ids for its continuation."""

from __future__ import annotations

import asyncio

import httpx
from fastapi.responses import StreamingResponse

from shoal.fleet.admission.dispatch import ReplicaLease
from shoal.fleet.proxy.forward import Forward
from shoal.fleet.proxy.parts import RelayParts
from shoal.fleet.proxy.stream_state import Tag
from shoal.fleet.proxy.upstream import Attempt
from shoal.fleet.replicas.replica import Health
from shoal.protocol.errors import error_body
from shoal.protocol.sse import sse

_closing: set[asyncio.Task] = set()  # cleanup tasks outliving their relay (the loop holds tasks weakly)


def keep(task: asyncio.Task) -> None:
    _closing.add(task)
    task.add_done_callback(_closing.discard)


def with_usage(body: dict) -> dict:
    """The upstream always reports usage (the tenant's tokens); the client sees it only if it asked.
    A copy: the client's body stays as it came (its poison fingerprint, say)."""
    options = body.get("stream_options")
    if not isinstance(options, dict | None) or (options or {}).get("include_usage"):
        return body
    return {**body, "stream_options": {**(options or {}), "include_usage": True}}


def response_headers(up: Upstream) -> dict[str, str]:
    rid = up.resp.headers.get("x-request-id")
    return {"x-replica": up.replica.name, **({"x-request-id": rid} if rid else {})}


class RelayResponse(StreamingResponse):
    """A relayed stream that cleans up after itself however the response ends, even when the
    client left before its first byte (and the generator never started)."""

    def __init__(self, cleanup, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cleanup()


class StopRelay(Exception):
    """Ends the client's stream with an in-band error."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.event = sse(error_body(status, message, code=code))


class Upstream:
    def __init__(self, attempt: Attempt, resp: httpx.Response, tag: Tag, with_ids: bool, lease: ReplicaLease):
        self.attempt = attempt
        self.resp = resp
        self.tag = tag
        self.with_ids = with_ids  # asked for token ids: its output can be continued exactly
        self.lease = lease  # its replica, held until the stream ends there

    @property
    def replica(self):
        return self.attempt.replica


async def prompt_ids_from_a_replica(
    parts: RelayParts, fwd: Forward, text: str, exclude: set[str]
) -> list[int] | None:
    """`text` tokenized by the first ready replica not in `exclude` that answers."""
    for r in parts.table.replicas.values():
        if r.state == Health.READY and r.name not in exclude:
            try:
                resp = await parts.client.http.post(
                    r.url + "/tokenize",
                    json={"model": fwd.body.get("model"), "prompt": text},
                    timeout=parts.config.first_byte_timeout_s,
                )
                if resp.status_code == 200:
                    return resp.json()["tokens"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
    return None
