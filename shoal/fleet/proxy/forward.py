"""One client request on its way through the proxy, and the responses the proxy makes of what
replicas answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from fastapi.responses import JSONResponse, Response

from shoal.fleet.routing.policies import RouteRequest
from shoal.protocol.errors import error_body

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
    output_ids: list[list[int]] | None = None  # each choice's tokens, where a relay knew them all
    # Set when a shadow copy waits to compare its answer with this one's (see shadow.py).
    primary_output: asyncio.Future | None = field(default=None, repr=False)

    def settle(self) -> None:
        """Tells admission the request has ended (once), with the tokens it used."""
        done, self.on_done = self.on_done, None
        if done is not None:
            done(self)
        if self.primary_output is not None and not self.primary_output.done():
            self.primary_output.set_result(self.output_ids)


def unavailable(message: str) -> JSONResponse:
    return JSONResponse(
        error_body(503, message, code="no_replica"), status_code=503, headers={"Retry-After": "1"}
    )


def passthrough(resp: httpx.Response, content: bytes) -> Response:
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
    return Response(content, status_code=resp.status_code, headers=headers)


def json_or_none(content: bytes):
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
