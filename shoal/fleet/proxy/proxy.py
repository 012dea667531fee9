"""Forwards OpenAI requests to replicas: retries where the request provably did not run (or the
replica said so), continuation of streams after the first byte, no second replica for poison.

Timeouts: `first_byte_timeout_s` for a stream's headers and first event, `stream_idle_timeout_s`
between events, `request_timeout_s` for the whole of a non-streamed request. A timeout on a
replica that still passes probes is not held against it, and a non-streamed request that timed
out is not run again (it may still be running). A replica marked down (probe failure) interrupts
its requests at once: streams continue elsewhere, and so do non-streamed completions on shoal's
replicas (relayed as streams, fold.py); other non-streamed requests run again elsewhere.
"""

from __future__ import annotations

import time

from fastapi.responses import Response, StreamingResponse

from shoal.fleet.proxy.fold import foldable
from shoal.fleet.proxy.forward import Forward
from shoal.fleet.proxy.parts import RelayParts
from shoal.fleet.proxy.poison import poison_error
from shoal.fleet.proxy.stream_relay import StreamRelay
from shoal.fleet.proxy.unary import UnaryRelay


class Proxy:
    """The proxy's top: a request refused as poison stops here; a stream goes to its own relay, and
    so does a non-streamed completion, relayed as a stream (fold.py); anything else to the unary
    relay. The request is settled (admission told it ended) once."""

    def __init__(self, parts: RelayParts):
        self.parts = parts
        self.unary = UnaryRelay(parts)

    async def handle(self, fwd: Forward) -> Response:
        p = self.parts
        p.retries.earn()
        left = await p.judge.refused_for(fwd)
        if left:
            p.metrics.e2e.observe(time.monotonic() - fwd.started)
            fwd.settle()
            return poison_error(
                f"this request took a replica down; identical requests are refused for {left:.0f} s"
            ).response()
        if fwd.body.get("stream") is True:
            resp = await StreamRelay(p, fwd).start()
            if not isinstance(resp, StreamingResponse):
                fwd.settle()  # it never streamed; else the stream settles when it ends
            return resp
        if p.config.fold_unary and foldable(fwd.path, fwd.body) and self._continuable(fwd):
            return await StreamRelay(p, fwd, folded=True).answer()  # settles when it ends
        try:
            return await self.unary.run(fwd)
        finally:
            p.metrics.e2e.observe(time.monotonic() - fwd.started)
            fwd.settle()

    def _continuable(self, fwd: Forward) -> bool:
        """Whether the replicas that may serve it are shoal's (they say their token ids, so its
        output can be continued exactly); any other backend runs it again instead, unfolded."""
        serving = self.parts.table.serving(fwd.route.model, time.monotonic())
        return bool(serving) and all(r.kv_events for r in serving)
