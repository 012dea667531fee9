"""API keys, backpressure past the waiting-queue bound, and a dead engine loop."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from shoal.engine.async_engine import AsyncEngine, AsyncEngineConfig
from shoal.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from shoal.engine.core import EngineCore
from shoal.server.app import ServerState, build_app
from shoal.server.common import ServingContext
from shoal.server.metrics import ServerMetrics
from tests.server_helpers import free_port, start_server

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def guarded():
    s = start_server(
        "--api-key", KEY, "--kv-cache-memory", "128MiB", "--max-num-seqs", "2", "--max-waiting-requests", "2"
    )
    yield s
    s.stop()


def test_api_key_is_required_on_the_api_but_not_on_probes(guarded):
    bare = guarded.post(
        "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2}
    )  # no Authorization header
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    c = openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        c.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "invalid_api_key"
    ok = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2).choices
    assert guarded.get("/health").status_code == 200 and guarded.get("/metrics").status_code == 200


def test_past_the_waiting_bound_requests_get_503_with_retry_after(guarded):
    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=120) as c:
            body = {
                "model": "SmolLM2-135M-Instruct",
                "prompt": "Count to a hundred:",
                "max_tokens": 48,
                "ignore_eos": True,
            }
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(12)))

    results = asyncio.run(run())
    codes = [r.status_code for r in results]
    assert codes.count(200) >= 2 and codes.count(503) >= 1 and set(codes) <= {200, 503}, codes
    for r in results:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "service_unavailable"
        else:
            assert r.json()["usage"]["completion_tokens"] == 48  # admitted work is never dropped
    guarded.wait_idle()


class _InProcessServer:
    """The app and a real engine in this process, so the test can break the engine loop."""

    def __init__(self, bundled):
        cfg = EngineConfig(cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_num_seqs=4))
        self.engine = EngineCore(cfg, loaded=bundled)
        front = AsyncEngine(self.engine, AsyncEngineConfig(stall_timeout_s=1.0)).start()
        ctx = ServingContext(
            front, self.engine.tokenizer, "m", self.engine.max_model_len, ServerMetrics("m", front.stats)
        )
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(build_app(ServerState(ctx=ctx)), port=port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.front = front

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.front.shutdown()


def test_a_stalled_then_dead_engine_is_unhealthy(bundled):
    srv = _InProcessServer(bundled)
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        real_step = srv.engine.step
        release = threading.Event()

        def stalled_step():
            release.wait(10)
            raise RuntimeError("injected engine failure")

        srv.engine.step = stalled_step

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                pending = asyncio.create_task(
                    c.post(
                        "/v1/completions",
                        json={"model": "m", "prompt": "hi", "max_tokens": 4},
                    )
                )
                await asyncio.sleep(1.5)  # past the 1 s stall timeout
                stalled = await c.get("/health")
                release.set()
                failed = await pending
                await asyncio.sleep(0.2)
                return (
                    stalled,
                    failed,
                    await c.get("/health"),
                    await c.get("/ready"),
                    await c.post(
                        "/v1/completions",
                        json={"model": "m", "prompt": "hi", "max_tokens": 4},
                    ),
                )

        stalled, failed, dead, ready, after = asyncio.run(run())
        assert stalled.status_code == 503 and "running for" in stalled.json()["reason"]
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_dead"
        assert dead.status_code == 503 and "injected engine failure" in dead.json()["reason"]
        assert ready.status_code == 503
        assert after.status_code == 503
        srv.engine.step = real_step
    finally:
        srv.stop()
