"""The gateway under hostile input and failure, against real `shoal fleet up` / `shoal gateway`
processes on 127.0.0.1: body limits and strict JSON, API keys towards clients and replicas,
client priority, salted KV hashes, a frozen replica (SIGSTOP) mid-stream, a replica drained by
SIGTERM."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
from collections import Counter

import httpx
import pytest
from fastapi import Request

from shoal.protocol.block_hash import hash_blocks, root_hash
from tests.fleet_helpers import FLEET_KEY as KEY
from tests.fleet_helpers import auth, metric, replicas, start_gateway, wait_replicas_ready
from tests.server_helpers import StandIn, stand_in_app, stream_gaps

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fleet(shared_fleet):
    """Three replicas behind KEY (see conftest), shared with test_fleet and test_fleet_crash."""
    wait_replicas_ready(shared_fleet, 3, api_key=KEY)
    return shared_fleet


@pytest.fixture(scope="module")
def big_gateway(fleet):
    """A second gateway over the same replicas that takes bodies up to 8 MiB (replicas take 4)."""
    urls = [r["url"] for r in replicas(fleet, KEY).values()]
    gw = start_gateway(urls, "--max-request-bytes", "8MiB", api_key=KEY)
    yield gw
    gw.stop()


def post(gw, path, headers=None, **kw):
    return httpx.post(gw.url + path, timeout=120, headers={**auth(KEY), **(headers or {})}, **kw)


def is_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# --- hostile input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}',
        b'{"prompt": "x", "max_tokens": 2, "temperature": Infinity}',
        b'{"prompt": "\\ud800 lone", "max_tokens": 2}',
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"[1, 2, 3]",
        b'"just a string"',
        b'{"prompt": "unterminated',
        b"\xff\xfe not utf-8",
    ],
    ids=["nan", "infinity", "lone-surrogate", "deep", "array", "string", "truncated", "bytes"],
)
def test_hostile_json_gets_a_400_in_openai_format(fleet, raw):
    r = post(fleet, "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert is_openai_error(r, 400)["type"] == "invalid_request_error"
    assert fleet.get("/health").status_code == 200


def test_unknown_routes_and_methods_answer_in_openai_format(fleet):
    is_openai_error(fleet.get("/v1/nothing"), 404)
    is_openai_error(fleet.get("/v1/completions"), 405)


def test_a_body_past_the_limit_gets_413_unread(fleet):
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    r = post(fleet, "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert is_openai_error(r, 413)["code"] == "body_too_large"


def test_a_huge_prompt_stalls_neither_health_nor_other_streams(big_gateway):
    """A 5 MB prompt passes this gateway's limit (8 MiB); tokenizing it for routing would hold the
    event loop for seconds. The replica refuses it; the gateway meanwhile keeps answering."""
    huge = "the river bends near the stone. " * (5_000_000 // 32)
    body = {"model": MODEL, "prompt": "Count to twenty:", "max_tokens": 40, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=big_gateway.url, timeout=120, headers=auth(KEY)) as c:
            gaps: list[float] = []

            def stream():
                return stream_gaps(c, "/v1/completions", body, gaps)

            async def health():
                worst = 0.0
                for _ in range(30):
                    t0 = time.monotonic()
                    assert (await c.get("/health")).status_code == 200
                    worst = max(worst, time.monotonic() - t0)
                    await asyncio.sleep(0.05)
                return worst

            streaming = asyncio.create_task(stream())
            await asyncio.sleep(0.3)
            probing = asyncio.create_task(health())
            hostile = await asyncio.gather(
                *(c.post("/v1/completions", json={"model": MODEL, "prompt": huge}) for _ in range(2))
            )
            worst = await probing
            await streaming
            return hostile, worst, gaps

    hostile, worst, gaps = asyncio.run(run())
    for r in hostile:
        assert r.status_code in (400, 413, 503), r.text[:300]  # refused by the replica, however it does
    assert worst < 2.0, worst  # tokenizing 5 MB takes ~4 s here
    assert max(gaps) < 3.0, max(gaps)


# --- API keys -------------------------------------------------------------------------------


def test_keys_guard_the_api_and_the_replica_list_but_not_probes(fleet):
    for path in ("/replicas", "/v1/models"):
        assert is_openai_error(fleet.get(path), 401)["code"] == "invalid_api_key"
        assert fleet.get(path, headers=auth("wrong")).status_code == 401
    assert is_openai_error(httpx.post(fleet.url + "/v1/completions", json={"prompt": "x"}), 401)
    for path in ("/health", "/ready", "/metrics"):
        assert fleet.get(path).status_code == 200
    # The gateway forwards its key to the replicas, which require it too.
    models = fleet.get("/v1/models", headers=auth(KEY)).json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    r = post(fleet, "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    # The polls of replica load and KV events carry the key as well.
    for rep in replicas(fleet, KEY).values():
        assert rep["state"] == "ready" and "running" in rep["load"] and rep["kv_events"]


# --- client priority ------------------------------------------------------------------------


class RecordingBackend:
    """A stand-in OpenAI server that records the bodies it gets (the gateway is under test)."""

    def __init__(self):
        self.bodies: list[dict] = []
        app = stand_in_app()

        @app.post("/v1/completions")
        async def completions(raw: Request):
            self.bodies.append(await raw.json())
            return {"id": "x", "object": "text_completion", "choices": [], "usage": None}

        self.server = StandIn(app)
        self.url = self.server.url

    def close(self):
        self.server.close()


@pytest.mark.parametrize("trust", [False, True])
def test_clients_may_only_lower_their_priority(trust):
    backend = RecordingBackend()
    gw = start_gateway([backend.url], *(["--trust-client-priority"] if trust else []))
    try:
        for p in (-5, 0, 3, None):
            body = {"prompt": "x"} if p is None else {"prompt": "x", "priority": p}
            assert httpx.post(gw.url + "/v1/completions", json=body, timeout=30).status_code == 200
        seen = [b.get("priority") for b in backend.bodies]
        assert seen == ([-5, 0, 3, None] if trust else [0, 0, 3, None])
    finally:
        gw.stop()
        backend.close()


# --- salted KV hashes -----------------------------------------------------------------------


def _proc_env(pid: int) -> dict[bytes, bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")
def test_the_fleet_salts_kv_hashes_and_the_router_hashes_as_replicas_do(fleet):
    reps = replicas(fleet, KEY)
    salts = set()
    for rep in reps.values():
        env = _proc_env(rep["pid"])
        with open(f"/proc/{rep['pid']}/cmdline", "rb") as f:
            argv = f.read()
        salt = env[b"SHOAL_KV_SALT"]
        assert len(salt) >= 16 and salt not in argv  # a secret: not in argv, which anyone can read
        assert env[b"SHOAL_PARENT_PID"] == str(fleet.proc.pid).encode()
        salts.add(salt)
    assert len(salts) == 1  # one salt per fleet
    salt = salts.pop()
    ids = list(range(3000, 3064))  # four full blocks of 16
    cached = {name: rep["cached_blocks"] for name, rep in reps.items()}
    r = post(fleet, "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})
    name = r.headers["x-replica"]
    salted, plain = hash_blocks(ids, 16, root=root_hash(salt)), hash_blocks(ids, 16)
    feed = httpx.get(reps[name]["url"] + "/kv_events", headers=auth(KEY), timeout=10).json()
    stored = {e["block_hash"] for e in feed["events"] if e["kind"] == "stored"}
    assert set(salted) <= stored and not set(plain) & stored
    # The gateway indexed what it routed and what the replica reported as the same four blocks.
    time.sleep(1.0)  # several KV polls
    assert replicas(fleet, KEY)[name]["cached_blocks"] - cached[name] == 4


# --- frozen replicas and timeouts -----------------------------------------------------------


def test_a_frozen_replica_fails_its_streams_over_at_once(fleet):
    prompts = [f"Describe the harbour of city number {i}." for i in range(4)]
    body = {"model": MODEL, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # greedy: batching changes no token
        answers = pool.map(lambda p: post(fleet, "/v1/completions", json={**body, "prompt": p}), prompts)
        expected = {p: a.json()["choices"][0]["text"] for p, a in zip(prompts, answers, strict=True)}
    before = replicas(fleet, KEY)
    failovers = metric(fleet.url, "shoal:gateway_failovers_total")

    async def stream(c, p, seen):
        text, stamps = "", []
        async with c.stream("POST", "/v1/completions", json={**body, "prompt": p, "stream": True}) as r:
            assert r.status_code == 200
            seen[p] = [r.headers["x-replica"], 0]
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    obj = json.loads(line[6:])
                    assert "error" not in obj, obj
                    text += "".join(ch["text"] for ch in obj["choices"])
                    stamps.append(time.monotonic())
                    seen[p][1] = len(text)
        return text, stamps

    async def run():
        seen: dict = {}
        async with httpx.AsyncClient(base_url=fleet.url, timeout=300, headers=auth(KEY)) as c:
            tasks = [asyncio.create_task(stream(c, p, seen)) for p in prompts]
            while len(seen) < len(prompts) or min(n for _, n in seen.values()) < 30:
                await asyncio.sleep(0.02)
            victim = Counter(rep for rep, _ in seen.values()).most_common(1)[0][0]
            pid = before[victim]["pid"]
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                outs = await asyncio.gather(*tasks)
                state_while_stopped = replicas(fleet, KEY)[victim]["state"]
            finally:
                os.kill(pid, signal.SIGCONT)
            return victim, stopped, outs, seen, state_while_stopped

    victim, stopped, outs, seen, state = asyncio.run(run())
    assert state == "down"
    for p, (text, stamps) in zip(prompts, outs):
        assert text == expected[p], p  # greedy: as if nothing had happened
        if seen[p][0] == victim:
            resumed = next(t for t in stamps if t > stopped)
            assert resumed - stopped < 10, resumed - stopped  # detection ~2-3 s, not a timeout
    assert metric(fleet.url, "shoal:gateway_failovers_total") >= failovers + 1
    wait_replicas_ready(fleet, 3, api_key=KEY)  # the thawed replica takes traffic again


def test_timeouts_bound_streams_not_long_requests_and_never_run_twice(fleet, tmp_path):
    urls = [r["url"] for r in replicas(fleet, KEY).values()]
    body = {"model": MODEL, "prompt": "Write a long story.", "ignore_eos": True, "temperature": 0}
    cfg = tmp_path / "gw.toml"
    cfg.write_text("[gateway]\nfirst_byte_timeout_s = 0.3\n")
    gw = start_gateway(urls, "--config", str(cfg), api_key=KEY)
    try:  # a non-streamed request is not bound by the first-byte timeout
        r = post(gw, "/v1/completions", json={**body, "max_tokens": 64})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64
    finally:
        gw.stop()
    cfg.write_text("[gateway]\nrequest_timeout_s = 1.0\n")
    gw = start_gateway(urls, "--config", str(cfg), api_key=KEY)
    try:
        sent = sum(r["requests_total"] for r in replicas(gw, KEY).values())
        r = post(gw, "/v1/completions", json={**body, "max_tokens": 1500})
        assert is_openai_error(r, 504)["code"] == "timeout"
        after = replicas(gw, KEY)
        assert sum(r["requests_total"] for r in after.values()) == sent + 1  # not run a second time
        assert all(r["state"] == "ready" and r["consecutive_failures"] == 0 for r in after.values())
    finally:
        gw.stop()


def test_a_client_leaving_mid_stream_frees_its_replica(fleet):
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def leave_early():
        async with httpx.AsyncClient(base_url=fleet.url, timeout=60, headers=auth(KEY)) as c:
            for _ in range(3):
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n >= 5:
                            break

    asyncio.run(leave_early())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        reps = replicas(fleet, KEY).values()
        if all(r["inflight"] == 0 and r["load"].get("running") == 0 for r in reps):
            break
        time.sleep(0.1)
    assert all(r["inflight"] == 0 and r["load"].get("running") == 0 for r in reps), list(reps)


def test_sigterm_drains_a_replica_without_failing_a_request_and_it_exits_in_time(fleet):
    """SIGTERM on a replica under streaming load: from that moment it refuses new requests (503,
    code draining) and the gateway sends them elsewhere; the gateway's streams move off it and
    come out as if nothing happened; a stream sent to it directly (which no gateway can move)
    runs to its end; then it exits with 0, well within its shutdown timeout (30 s)."""
    prompts = [f"Tell the tale of lighthouse number {i}." for i in range(4)]
    body = {"model": MODEL, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    before = replicas(fleet, KEY)

    async def expected_texts(c):
        rs = await asyncio.gather(*(c.post("/v1/completions", json={**body, "prompt": p}) for p in prompts))
        return {p: r.json()["choices"][0]["text"] for p, r in zip(prompts, rs)}

    async def stream(c, url, p, seen):
        text = ""
        async with c.stream("POST", url, json={**body, "prompt": p, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            seen[p] = [r.headers.get("x-replica"), 0]
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                text += "".join(ch["text"] for ch in obj["choices"])
                seen[p][1] = len(text)
        return text

    async def run():
        seen: dict = {}
        async with httpx.AsyncClient(base_url=fleet.url, timeout=300, headers=auth(KEY)) as c:
            expected = await expected_texts(c)
            tasks = [asyncio.create_task(stream(c, "/v1/completions", p, seen)) for p in prompts]
            while len(seen) < len(prompts) or min(n for _, n in seen.values()) < 20:
                await asyncio.sleep(0.02)
            victim = Counter(rep for rep, _ in seen.values()).most_common(1)[0][0]
            url, pid = before[victim]["url"], before[victim]["pid"]
            direct = "Recite the alphabet slowly."
            direct_task = asyncio.create_task(stream(c, url + "/v1/completions", direct, seen))
            while seen.get(direct, (None, 0))[1] < 5:
                await asyncio.sleep(0.02)
            os.kill(pid, signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.2)
            refused = await c.post(url + "/v1/completions", json={**body, "prompt": "hi", "max_tokens": 2})
            ready = await c.get(url + "/ready")
            others = await asyncio.gather(
                *(
                    c.post("/v1/completions", json={**body, "prompt": f"Name {i}.", "max_tokens": 8})
                    for i in range(4)
                )
            )
            outs = await asyncio.gather(*tasks)
            direct_text = await direct_task
            direct_done = time.monotonic()
            while True:  # its process ends (the fleet reaps it and starts it again)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                assert time.monotonic() - signalled < 30, "still running past its shutdown timeout"
                await asyncio.sleep(0.05)
            return victim, expected, outs, refused, ready, others, direct_text, direct_done, time.monotonic()

    moved = metric(fleet.url, 'shoal:gateway_migrations_total{outcome="ok"}')
    victim, expected, outs, refused, ready, others, direct_text, direct_done, gone = asyncio.run(run())
    assert is_openai_error(refused, 503)["code"] == "draining" and refused.headers["retry-after"]
    assert ready.status_code == 503 and ready.json()["draining"] is True
    for r in others:
        assert r.status_code == 200 and r.headers["x-replica"] != victim, (r.status_code, r.text[:200])
    assert outs == [expected[p] for p in prompts]  # greedy: as if nothing had happened
    assert len(direct_text) > 0 and gone - direct_done < 5  # it waited for its own stream, then left
    assert metric(fleet.url, 'shoal:gateway_migrations_total{outcome="ok"}') > moved
    # The fleet reaps the process (which is what ended the loop above) a moment before it logs
    # the exit code.
    deadline = time.monotonic() + 10
    while f"{victim} exited with 0" not in fleet.log():
        assert time.monotonic() < deadline, fleet.log()[-2000:]
        time.sleep(0.1)
    wait_replicas_ready(fleet, 3, api_key=KEY)


def test_sigterm_on_the_fleet_lets_its_streams_finish_then_stops_everything(fleet):
    """The last test on the shared fleet (conftest): SIGTERM on `fleet up` refuses new
    connections at once, lets the streams in flight run to their end, then stops its replicas
    and exits with 0, within its shutdown timeout (30 s)."""
    pids = [r["pid"] for r in replicas(fleet, KEY).values()]
    body = {"model": MODEL, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}

    async def stream(c, p, counts):
        reason, usage = None, None
        async with c.stream("POST", "/v1/completions", json={**body, "prompt": p}) as r:
            assert r.status_code == 200
            counts[p] = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    obj = json.loads(line[6:])
                    assert "error" not in obj, obj
                    counts[p] += len(obj["choices"])
                    ends = [ch["finish_reason"] for ch in obj["choices"] if ch["finish_reason"]]
                    reason = ends[0] if ends else reason
                    usage = obj.get("usage") or usage
        return reason, usage["completion_tokens"]

    async def run():
        counts: dict = {}
        prompts = ["Describe a storm at sea.", "Describe a quiet forest."]
        async with httpx.AsyncClient(base_url=fleet.url, timeout=120, headers=auth(KEY)) as c:
            tasks = [asyncio.create_task(stream(c, p, counts)) for p in prompts]
            while len(counts) < 2 or min(counts.values()) < 5:
                await asyncio.sleep(0.02)
            fleet.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)
            with pytest.raises(httpx.ConnectError):
                await c.post("/v1/completions", json={**body, "stream": False, "prompt": "hi"})
            reasons = await asyncio.gather(*tasks)
        return reasons, signalled

    reasons, signalled = asyncio.run(run())
    assert reasons == [("length", 120), ("length", 120)]
    assert fleet.proc.wait(30) == 0 and time.monotonic() - signalled < 30
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
