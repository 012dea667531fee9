"""What the cross-host fleet tests share: test hosts made of network namespaces
(shoal.testing.hosts), `shoal serve` and `shoal gateway` on them, what a replica says of itself,
and seeded streams opened at once with a fault injected once each is midway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from shoal.testing import netns
from shoal.testing.hosts import Cluster, ClusterConfig, Host, available
from tests.fleet_helpers import metric, replicas, spawn, wait_replicas_ready
from tests.server_helpers import ServerProcess
from tests.server_helpers import wait_ready as server_ready

MODEL = "SmolLM2-135M-Instruct"
KEY, SALT = "cross-host-transfer-key", "cross-host-salt"
KV_ENV = {"SHOAL_KV_TRANSFER_KEY": KEY, "SHOAL_KV_SALT": SALT}
COMMON_ARGS = ("--kv-cache-memory", "256MiB", "--threads", "1")
STREAMS = 8
FAULT_AFTER = 8  # tokens every stream has when the fault comes
STAGGER_S = 0.02  # between the openings of the streams of one fault test
DOWN_BOUND_S = 15.0  # a cut link is seen as a replica down within this (measured: ~2-3 s)


@contextlib.contextmanager
def host_cluster(hosts: int):
    """A module's test hosts, or a skip where they cannot be made. The session's kernel and model
    cache (conftest) stays visible on them: their replicas load what this process built instead
    of building it again."""
    reason = available()
    if reason is not None:
        pytest.skip(f"no test hosts here: {reason}")
    cache = os.environ.get("SHOAL_CACHE_DIR")
    keep = (*netns.default_keep(), *([cache] if cache else []))
    with Cluster(ClusterConfig(hosts=hosts, keep=keep)) as c:
        yield c


def serve(host: Host, port: int, *args: str, env: dict | None = None) -> ServerProcess:
    """`shoal serve` on `host`, listening on its address; its log in this namespace's /tmp."""
    fd, log_path = tempfile.mkstemp(prefix=f"shoal-{host.name}-{port}-", suffix=".log")
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--host", host.address, "--port", str(port), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **KV_ENV, **(env or {})}
    with os.fdopen(fd, "w") as log:
        proc = host.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return ServerProcess(f"http://{host.address}:{port}", proc, log_path)


def wait_ready(servers: list[ServerProcess], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    for s in servers:
        server_ready(s, max(0.0, deadline - time.monotonic()))


def gateway(backends: list[str], tmp_path, name: str, **settings) -> ServerProcess:
    """`shoal gateway` here over `backends` (backend-0, backend-1, ... in this order)."""
    config = tmp_path / f"{name}.toml"
    config.write_text("[gateway]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    flags = [f for url in backends for f in ("--backend", url)]
    gw = spawn(["gateway", *flags, "--config", str(config)], env=KV_ENV)
    try:
        wait_replicas_ready(gw, len(backends), timeout=60)
    except BaseException:
        gw.stop()
        raise
    return gw


def stop_all(procs: list[ServerProcess]) -> None:
    for p in procs:
        p.stop()


# --- what a replica says ---------------------------------------------------------------------


def load(url: str, headers: dict | None = None) -> dict:
    return httpx.get(url + "/load", timeout=5, headers=headers).json()


def wait_idle(url: str, timeout: float = 30.0, headers: dict | None = None) -> dict:
    """Nothing running, waiting or held, no KV block in use (polled through one client, as
    ServerProcess says why)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5, headers=headers) as client:
        while True:
            now = client.get(url + "/load").json()
            if now["running"] == now["waiting"] == now.get("kv_held", 0) == 0 and now["kv_usage"] == 0:
                return now
            assert time.monotonic() < deadline, f"{url} not idle: {now}"
            time.sleep(0.2)


def samples(text: str, name: str) -> dict[str, float]:
    """The samples on a /metrics page whose names start with `name`: {'name{labels}': value}
    (without the counters' _created timestamps)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {_":
            key, value = line.rsplit(" ", 1)
            if "_created" not in key:
                out[key] = float(value)
    return out


def reasons(text: str) -> dict[str, float]:
    """Finished requests by reason, on a /metrics page."""
    got = samples(text, "shoal:request_success_total")
    return {re.search(r'finished_reason="(\w+)"', k).group(1): v for k, v in got.items()}


def finished(url: str) -> dict[str, float]:
    """A replica's finished requests by reason."""
    return reasons(httpx.get(url + "/metrics", timeout=10).text)


def less(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def decisions(gw: ServerProcess, decision: str) -> float:
    return metric(gw.url, f'shoal:gateway_disagg_decisions_total{{decision="{decision}"}}')


def transfers(url: str, transport: str) -> float:
    return metric(url, f'shoal:kv_transfer_duration_seconds_count{{transport="{transport}"}}')


# --- streams under a fault -----------------------------------------------------------------

STORY = [
    "Write a short story about a lighthouse keeper.",
    "Describe the harbour at dawn.",
    "Tell me about the history of the bicycle.",
    "Explain how bees make honey.",
    "Write a letter to a friend who moved away.",
    "Describe a walk through a pine forest in winter.",
    "What makes a good cup of tea?",
    "Tell a tale of two rival bakers.",
]


def stream_bodies(seed: int, tokens: int) -> list[dict]:
    """STREAMS seeded sampling requests. The gateway's poison guard strikes a request each time
    a replica dies under it and convicts at the second strike; a partition is no death once its
    replica is back as the same process, so the kill test sends the very requests a partition
    moved, and they must not be taken for poison."""
    return [
        {
            "model": MODEL,
            "prompt": STORY[i],
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0.8,
            "seed": seed + i,
            "return_token_ids": True,
        }
        for i in range(STREAMS)
    ]


def expected_on(url: str, bodies: list[dict], headers: dict | None = None) -> list[list[int]]:
    """Each request's tokens from one replica directly, uninterrupted (all at once, as they run)."""

    async def one(c: httpx.AsyncClient, body: dict) -> list[int]:
        r = await c.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async def go():
        async with httpx.AsyncClient(timeout=120, headers=headers) as c:
            return await asyncio.gather(*(one(c, b) for b in bodies))

    return asyncio.run(asyncio.wait_for(go(), 180))


async def _stream(c: httpx.AsyncClient, url: str, body: dict, seen: list[int], i: int) -> dict:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out = {"replica": None, "ids": [], "finish": [], "errors": [], "chunk_ids": set(), "usage": None}
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        out["replica"] = r.headers.get("x-replica")  # None: a replica asked directly
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                out["errors"].append(obj)
                break
            out["chunk_ids"].add(obj["id"])
            out["usage"] = obj.get("usage") or out["usage"]
            for ch in obj["choices"]:
                out["ids"] += ch.get("token_ids") or []
                if ch.get("finish_reason"):
                    out["finish"].append(ch["finish_reason"])
            seen[i] = len(out["ids"])
    return out


def streams_with_fault(
    url: str,
    bodies: list[dict],
    fault,
    timeout: float = 180.0,
    direct: tuple[tuple[str, dict], ...] = (),
    headers: dict | None = None,
) -> tuple[list[dict], object]:
    """The requests streamed at once through `url` (and each of `direct`, (url, body), beside
    them, its stream last among those returned); once each has FAULT_AFTER tokens (and none is
    done), `fault()` (a coroutine) runs beside them. Returns the streams and what fault returned.
    They open STAGGER_S apart, in order: a round-robin gateway then gives stream i the replica it
    gave stream i the last time (concurrent connections would reach it in any order)."""
    sent = [(url, b) for b in bodies] + list(direct)
    seen = [0] * len(sent)

    async def act():
        while min(seen) < FAULT_AFTER:
            await asyncio.sleep(0.02)
        assert max(seen) < min(b["max_tokens"] for _, b in sent), seen  # every stream is midway
        return await fault()

    async def opened(c: httpx.AsyncClient, i: int, u: str, b: dict) -> dict:
        await asyncio.sleep(i * STAGGER_S)
        return await _stream(c, u, b, seen, i)

    async def go():
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=10), headers=headers) as c:
            actor = asyncio.create_task(act())
            try:
                outs = await asyncio.gather(*(opened(c, i, u, b) for i, (u, b) in enumerate(sent)))
            except BaseException:
                actor.cancel()
                raise
            return outs, await asyncio.wait_for(actor, 60)

    return asyncio.run(asyncio.wait_for(go(), timeout))


def assert_streams_exact(outs: list[dict], bodies: list[dict], expected: list[list[int]]) -> None:
    for i, (out, body, want) in enumerate(zip(outs, bodies, expected, strict=True)):
        assert not out["errors"], (i, out["errors"])
        assert len(out["chunk_ids"]) == 1, i  # one stream, one id
        assert out["finish"] == ["length"], (i, out["finish"])
        assert out["ids"] == want, i
        assert out["usage"]["completion_tokens"] == body["max_tokens"], (i, out["usage"])


def state(gw: ServerProcess, name: str) -> str:
    return replicas(gw)[name]["state"]


def wait_state(gw: ServerProcess, name: str, want: str, timeout: float) -> float:
    """Seconds until the gateway says `name` is in state `want`."""
    t0 = time.monotonic()
    while (now := state(gw, name)) != want:
        assert time.monotonic() - t0 < timeout, f"{name} still {now} after {timeout}s"
        time.sleep(0.05)
    return time.monotonic() - t0


def on_host(host: Host, url: str) -> str:
    """GET `url` from inside `host` (reachable while its link is cut)."""
    fetch = "import sys, httpx; print(httpx.get(sys.argv[1], timeout=5).text)"
    return host.check_output([sys.executable, "-c", fetch, url], timeout=15)
