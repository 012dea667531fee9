"""The HTTP glue of the KV connector (shoal.engine.kv_connector) for prefill/decode
disaggregation: a prefill worker keeps a finished prompt's K/V (`do_remote_decode`) and hands it
out on `/kv/pull`; a decode worker pulls it before admitting the request and loads it instead of
computing the prompt, then acknowledges, and only then does the prefill worker free the blocks.
A pull that fails or stalls past `transfer_timeout_s` leaves the decode worker to compute the
prompt itself: slower, never wrong.

Every request carrying `kv_transfer_params` and every `/kv/*` call must bear the fleet's transfer
key: with it a caller can hold blocks and make a worker open connections to a URL it names."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from dataclasses import dataclass, field

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter, Histogram

from shoal.engine.async_engine import AsyncEngine
from shoal.engine.kv_connector.frames import TransferError
from shoal.engine.kv_connector.packing import PackedKV
from shoal.engine.kv_connector.transports import (
    KVTransport,
    check_transport,
    choose,
    shm_probe,
    transport_named,
)
from shoal.engine.request_checks import RequestRejectedError
from shoal.protocol import tracing
from shoal.protocol.errors import APIError
from shoal.protocol.kv_files import shm_sweep, shm_unlink
from shoal.protocol.secrets import KV_TRANSFER_KEY_ENV, KV_TRANSFER_KEY_HEADER
from shoal.server.protocol import KVTransferParams

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
MAX_PREFIX_BLOCKS = 1 << 16  # a prompt of a million tokens, at 16 a block
SWEEP_INTERVAL_S = 5.0
BYTES_BUCKETS = tuple(2.0**i for i in range(12, 34, 2))  # 4 KiB .. 8 GiB
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass
class KVConnectorConfig:
    role: str = "both"  # what the gateway uses this worker for; every role can serve whole requests
    transfer_key: str | None = field(default_factory=lambda: os.environ.get(KV_TRANSFER_KEY_ENV) or None)
    transport: str = "auto"  # shm on one host, tcp between hosts (see engine.kv_connector)
    transfer_timeout_s: float = 10.0  # a pull past this is given up and the prompt computed here
    hold_timeout_s: float = 30.0  # held K/V nobody pulls is freed after this (the engine's own bound)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose from {', '.join(ROLES)}")
        check_transport(self.transport)


@dataclass
class _Handoff:
    since: float  # when the prefill finished and its K/V began to wait
    sent: tuple[KVTransport, str] | None = None  # a copy sent that its puller may not take


class KVConnector:
    def __init__(self, config: KVConnectorConfig, engine: AsyncEngine, registry, api_key: str | None):
        self.config = config
        self.engine = engine
        self.api_key = api_key
        shm_sweep()  # what workers killed on this host left behind (their probes too)
        # Published with each handoff: a puller that finds this file shares our /dev/shm.
        self.host = shm_probe()
        self.handoffs: dict[str, _Handoff] = {}
        self._client: httpx.AsyncClient | None = None
        self._sweeper: asyncio.Task | None = None
        self._acks: set[asyncio.Task] = set()
        self.bytes = Histogram(
            "shoal:kv_transfer_request_bytes",
            "K/V bytes moved per request, by direction and transport.",
            ["direction", "transport"],
            buckets=BYTES_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "shoal:kv_transfer_duration_seconds",
            "Time a decode worker spent pulling one request's K/V.",
            ["transport"],
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            "shoal:kv_transfer_queue_seconds",
            "Time a prefilled request's K/V waited on its prefill worker before it was pulled.",
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )
        self.peer_blocks = Counter(
            "shoal:kv_peer_fetched_blocks",
            "Prompt blocks fetched from a peer replica that held them, instead of computed here.",
            registry=registry,
        )
        self.fallbacks = Counter(
            "shoal:kv_transfer_fallbacks",
            "Requests whose K/V did not arrive (or did not fit) and whose prompt was computed here.",
            ["reason"],
            registry=registry,
        )

    # --- who may ask -------------------------------------------------------------------------

    def authorize(self, raw: Request) -> None:
        key = self.config.transfer_key
        given = raw.headers.get(KV_TRANSFER_KEY_HEADER, "")
        if not key or not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(
                403,
                "kv_transfer_params and /kv/* are for the fleet's gateway and workers (they need the "
                "fleet's KV transfer key)",
                "kv_transfer_params",
                "kv_transfer_forbidden",
            )

    # --- engine options for one request ------------------------------------------------------

    async def request_options(
        self, kv: KVTransferParams, raw: Request, prompts: list[list[int]], lora: str | None = None
    ) -> dict:
        """add_request options for a request's kv_transfer_params: hold its K/V (prefill side), or
        load the K/V pulled from its prefill worker (decode side), or from a peer holding its
        prefix; none when the pull failed (the prompt is computed here)."""
        self.authorize(raw)
        if len(prompts) != 1:
            raise APIError(400, "kv_transfer_params takes one prompt", "kv_transfer_params")
        if kv.do_remote_decode:
            return {"hold_kv": True}
        if kv.prefix:
            hashes = self.engine.prompt_hashes(prompts[0], lora)
            packed = await self.pull(kv, {"hashes": hashes}, "/kv/prefix") if hashes else None
            if packed is not None:
                self.peer_blocks.inc(len(packed.block_hashes))
        else:
            packed = await self.pull(kv, {"handle": kv.handle}, "/kv/pull")
        return {} if packed is None else {"external_kv": packed}

    def handoff(self, rid: str) -> dict:
        """The kv_transfer_params a prefill worker answers with: where decode pulls from."""
        self.handoffs[rid] = _Handoff(time.monotonic())
        self._start_sweeper()
        return {"handle": rid, "host": self.host}

    def rejected(self, reason: str) -> None:
        """The engine refused the pulled K/V (it does not match this prompt): computed here."""
        self.fallbacks.labels("mismatch").inc()
        log.warning("pulled K/V refused; computing the prompt here: %s", reason)

    # --- decode side -------------------------------------------------------------------------

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {KV_TRANSFER_KEY_HEADER: self.config.transfer_key or ""}
            if self.api_key:
                headers["authorization"] = f"Bearer {self.api_key}"
            self._client = httpx.AsyncClient(headers=headers, timeout=self.config.transfer_timeout_s)
        return self._client

    async def pull(self, kv: KVTransferParams, ask: dict, route: str) -> PackedKV | None:
        transport = choose(self.config.transport, kv.host)
        with tracing.child(
            "kv.transfer", None, **{"shoal.transport": transport.name, "shoal.source": kv.source}
        ) as span:
            packed = await self._pull(kv, ask, route, transport)
            span.set_attribute("shoal.bytes", packed.nbytes if packed is not None else 0)
            span.set_attribute("shoal.fell_back", packed is None)
        return packed

    async def _pull(
        self, kv: KVTransferParams, ask: dict, route: str, transport: KVTransport
    ) -> PackedKV | None:
        t0 = time.monotonic()
        try:
            fetch = self._fetch(kv.source.rstrip("/") + route, ask, transport)
            packed = await asyncio.wait_for(fetch, self.config.transfer_timeout_s)
        except TimeoutError:
            return self._fell_back("timeout", kv, f"no K/V within {self.config.transfer_timeout_s:.1f} s")
        except (httpx.HTTPError, TransferError, ValueError, KeyError) as exc:
            return self._fell_back("error", kv, f"{type(exc).__name__}: {exc}")
        self.duration.labels(transport.name).observe(time.monotonic() - t0)
        self.bytes.labels("received", transport.name).observe(packed.nbytes)
        if kv.prefix:
            return packed  # a copy of cached blocks: the peer holds nothing for us
        task = asyncio.get_running_loop().create_task(self._acknowledge(kv))
        self._acks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._acks.discard)
        return packed

    async def _fetch(self, url: str, ask: dict, transport: KVTransport) -> PackedKV:
        body = {**ask, "transport": transport.name}
        if transport.reply_is_json:
            resp = await self.client.post(url, json=body)
            resp.raise_for_status()
            return await asyncio.to_thread(transport.take, resp.json())
        async with self.client.stream("POST", url, json=body) as resp:
            resp.raise_for_status()
            size = int(resp.headers.get("content-length", "-1"))
            if size < 0:
                raise TransferError("the K/V response has no length")
            buf, at = bytearray(size), 0
            async for chunk in resp.aiter_raw():
                if at + len(chunk) > size:
                    raise TransferError("the K/V response is longer than it said")
                buf[at : at + len(chunk)] = chunk
                at += len(chunk)
            if at != size:
                raise TransferError(f"the K/V response ended after {at} of {size} bytes")
        return transport.take(buf)

    def _fell_back(self, reason: str, kv: KVTransferParams, detail: str) -> None:
        self.fallbacks.labels(reason).inc()
        log.warning("K/V pull from %s failed (%s); computing the prompt here", kv.source, detail)
        return None

    async def _acknowledge(self, kv: KVTransferParams) -> None:
        """Tells the prefill worker it may free the blocks (it frees them anyway after its hold
        timeout, so a lost acknowledgement costs memory for a while, not correctness)."""
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(kv.source.rstrip("/") + "/kv/release", json={"handle": kv.handle})

    # --- prefill side, and a peer's ----------------------------------------------------------

    async def serve_prefix(self, raw: Request, body: dict) -> Response:
        """The K/V of the leading blocks of a prompt's chain that this replica holds, for a peer."""
        self.authorize(raw)
        hashes, name = body.get("hashes"), body.get("transport", "tcp")
        if (
            not isinstance(hashes, list)
            or not 0 < len(hashes) <= MAX_PREFIX_BLOCKS
            or not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**64 for h in hashes)
            or name not in ("shm", "tcp")
        ):
            raise APIError(400, f"give 1 to {MAX_PREFIX_BLOCKS} block hashes and a transport", "hashes")
        try:
            packed = await self.engine.export_prefix(hashes)
        except RequestRejectedError as exc:
            raise APIError(400, str(exc), "hashes") from None
        if packed is None:
            raise APIError(404, "none of these blocks is held here", "hashes", "kv_not_found")
        return await self._send(packed, name)

    async def serve_pull(self, raw: Request, body: dict) -> Response:
        self.authorize(raw)
        handle, name = body.get("handle"), body.get("transport", "tcp")
        if not isinstance(handle, str) or name not in ("shm", "tcp"):
            raise APIError(400, "give a handle and a transport (shm or tcp)", "handle")
        try:
            packed = await self.engine.export_kv(handle)
        except KeyError:
            raise APIError(404, f"no K/V is held under {handle[:80]!r}", "handle", "kv_not_found") from None
        h = self.handoffs.get(handle)
        if h is not None:
            self.queue_time.observe(time.monotonic() - h.since)
        return await self._send(packed, name, handle)

    async def _send(self, packed: PackedKV, name: str, handle: str | None = None) -> Response:
        transport = transport_named(name)
        self.bytes.labels("sent", name).observe(packed.nbytes)
        reply, ref = await asyncio.to_thread(transport.send, packed)
        if ref is not None:
            # A file the puller takes; if it never does, the sweeper removes it. (A peer's copy of
            # prefix blocks has no handle of its own: the file names it.)
            h = self.handoffs.setdefault(handle or f"prefix:{ref}", _Handoff(time.monotonic()))
            if h.sent is not None:  # pulled before, by a decode worker that did not take it
                h.sent[0].discard(h.sent[1])
            h.sent = (transport, ref)
            self._start_sweeper()
        if isinstance(reply, dict):
            return JSONResponse(reply)
        return Response(reply, media_type="application/octet-stream")

    async def release(self, raw: Request, body: dict) -> dict:
        self.authorize(raw)
        handle = body.get("handle")
        if not isinstance(handle, str):
            raise APIError(400, "give a handle", "handle")
        released = await self.engine.release_kv(handle)
        self._forget(handle)
        return {"released": bool(released)}

    def _forget(self, handle: str) -> None:
        h = self.handoffs.pop(handle, None)
        if h is not None and h.sent is not None:
            h.sent[0].discard(h.sent[1])

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Forgets handoffs whose K/V the engine freed after its hold timeout (and their files)."""
        while self.handoffs:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            cutoff = time.monotonic() - self.config.hold_timeout_s - SWEEP_INTERVAL_S
            for handle in [k for k, h in self.handoffs.items() if h.since < cutoff]:
                self._forget(handle)

    async def close(self) -> None:
        for handle in list(self.handoffs):
            self._forget(handle)
        if self.host is not None:
            shm_unlink(self.host)
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._client is not None:
            await self._client.aclose()
