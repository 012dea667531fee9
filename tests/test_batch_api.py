"""The batch lane (OpenAI Batch API): the SQLite store's exactly-once bookkeeping, input validation,
the spare-capacity rule, the routes through the OpenAI SDK against an in-process gateway stand-in
(no model), and one real fleet whose gateway is killed -9 mid-batch and restarted."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import shutil
import time

import numpy as np
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai import OpenAI

from shoal.fleet.batch.api import install_batch_routes
from shoal.fleet.batch.redis_store import RedisBatchStore
from shoal.fleet.batch.runner import BatchService, parse_window, validate_input
from shoal.fleet.batch.store import BatchStore, result_line
from shoal.fleet.config import GatewayConfig
from shoal.protocol.bodies import BodyLimitMiddleware
from shoal.protocol.errors import APIError, error_body, install_error_handlers
from tests.fleet_helpers import start_redis, stop_redis


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def request(cid: str, prompt: str, url: str = "/v1/completions", **body) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": url,
        "body": {"prompt": prompt, "max_tokens": 4, **body},
    }


# --- the store ------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    """Each kind of batch store: a gateway's own (SQLite), and the one gateways share (Redis)."""
    if request.param == "sqlite":
        yield BatchStore(str(tmp_path / "b.sqlite3"))
        return
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server")
    proc, url = start_redis()
    try:
        yield RedisBatchStore(url, "test:batch:", 5.0)
    finally:
        stop_redis(proc)


def test_store_records_one_result_per_line_and_runs_interrupted_lines_again(store):
    f = store.add_file("alice", "batch", "in.jsonl", b"x")
    lines = [(f"c{i}", None, json.dumps({"prompt": str(i)})) for i in range(5)]
    b = store.add_batch("alice", "/v1/completions", f["id"], "24h", 86400, {"k": "v"}, lines, [])
    assert b["status"] == "in_progress" and b["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    assert store.get_batch("bob", b["id"]) is None and store.get_file("bob", f["id"]) is None

    first = store.claim(2)
    assert [(x.line_no, x.attempts) for x in first] == [(0, 1), (1, 1)]
    assert store.finish(first[0], True, result_line("c0", 200, {"n": 0}), (3, 1))
    assert not store.finish(first[0], True, result_line("c0", 200, {"n": 0}))  # one result only
    assert store.recover() == 1  # line 1 was running when "the gateway died"
    rest = store.claim(10)
    assert [(x.line_no, x.attempts) for x in rest] == [(1, 2), (2, 1), (3, 1), (4, 1)]
    # The runner that claimed line 1 first (a leader that was cut off) finishes it late: its
    # result is the one kept, and the second run's is dropped.
    assert store.finish(first[1], True, result_line("c1", 200, {"n": 1}))
    for x in rest:
        ok = x.line_no != 3
        err = None if ok else {"code": "x", "message": "no"}
        kept = store.finish(x, ok, result_line(x.custom_id, 200 if ok else 400, {"n": x.line_no}, err))
        assert kept == (x.line_no != 1)
    assert store.sweep() == {}
    done = store.get_batch("alice", b["id"])
    assert done["status"] == "completed" and done["completed_at"] and done["finalizing_at"]
    assert done["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
    assert done["usage"]["input_tokens"] == 3 and done["metadata"] == {"k": "v"}
    out = [json.loads(x) for x in store.file_content("alice", done["output_file_id"]).splitlines()]
    assert [o["custom_id"] for o in out] == ["c0", "c1", "c2", "c4"]
    assert out[0]["response"]["status_code"] == 200 and out[0]["error"] is None
    err = [json.loads(x) for x in store.file_content("alice", done["error_file_id"]).splitlines()]
    assert err[0]["custom_id"] == "c3" and err[0]["error"]["code"] == "x"
    assert store.get_file("alice", done["output_file_id"])["purpose"] == "batch_output"
    store.close()


def test_store_cancels_lists_pages_and_keeps_tenants_apart(store):
    files = [store.add_file("alice", "batch", f"{i}.jsonl", b"x") for i in range(3)]
    page, more = store.list_files("alice", None, 2, None)
    assert [f["id"] for f in page] == [files[2]["id"], files[1]["id"]] and more
    page, more = store.list_files("alice", "batch", 2, files[1]["id"])
    assert [f["id"] for f in page] == [files[0]["id"]] and not more
    assert store.list_files("bob", None, 10, None) == ([], False)
    lines = [(f"c{i}", None, "{}") for i in range(3)]
    b = store.add_batch("alice", "/v1/completions", files[0]["id"], "24h", 86400, None, lines, [])
    running = store.claim(1)
    assert store.cancel("bob", b["id"]) is None
    cancelling = store.cancel("alice", b["id"])
    assert cancelling["status"] == "cancelling" and cancelling["request_counts"]["failed"] == 2
    assert store.finish(running[0], True, result_line("c0", 200, {}))  # a running line finishes
    assert store.sweep() == {}
    done = store.get_batch("alice", b["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"]
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    errors = [json.loads(x) for x in store.file_content("alice", done["error_file_id"]).splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (f"c{i}", "batch_cancelled") for i in (1, 2)
    ]
    assert [x["id"] for x in store.list_batches("alice", 10, None)[0]] == [b["id"]]
    assert store.delete_file("alice", files[1]["id"]) and not store.delete_file("alice", files[1]["id"])
    assert store.get_file("alice", files[1]["id"]) is None
    store.close()


def test_validation_names_the_bad_lines_and_windows_take_short_units():
    good = request("a", "hi", stream=True, stream_options={"include_usage": True})
    rows = [good, {**request("b", "x"), "method": "GET"}, request("a", "dup"), {"custom_id": "c"}]
    content = (
        jsonl(rows)
        + b"{not json\n\n"
        + json.dumps({**request("d", "x"), "url": "/v1/chat/completions"}).encode()
    )
    lines, errors = validate_input(content, "/v1/completions")
    assert [e["line"] for e in errors] == [2, 3, 4, 5, 7]
    assert [e["code"] for e in errors] == [
        "invalid_method",
        "duplicate_custom_id",
        "invalid_method",
        "invalid_json_line",
        "mismatched_url",
    ]
    assert lines == [("a", None, json.dumps({"prompt": "hi", "max_tokens": 4, "stream": False}))]
    assert validate_input(b"\n", "/v1/completions")[1][0]["code"] == "empty_file"
    assert [parse_window(w) for w in ("24h", "30m", "5s")] == [86400, 1800, 5]
    for bad in ("0s", "24", "1d", "-1h", 24, None, "9999h"):
        with pytest.raises(APIError):
            parse_window(bad)


# --- the service and routes, on a stand-in gateway -------------------------------------------


class Tenant:
    def __init__(self, name: str):
        self.name = name


class FakeReplica:
    model = None


class FakeRegistry:
    """What the batch lane reads of the registry: free slots, requests waiting."""

    def __init__(self, cap: int):
        self.cap, self.busy, self.waiting_now = cap, 0, 0
        self.replicas = {"r0": FakeReplica()}
        self.fair = self

    def spare_slots(self, model):
        return self.cap - self.busy - self.waiting_now

    def waiting(self, model):
        return self.waiting_now

    def waiting_below(self, model, priority):
        return self.waiting_now

    def may_start(self, model):
        return not any(r.model == model for r in self.replicas.values())  # no fleet: none wakes


class FakeGateway:
    """Answers each request from its prompt: "bad" gets a 400, "flaky" a 503 the first time."""

    def __init__(self, state_dir, cap: int = 8, delay: float = 0.0, **cfg):
        self.config = GatewayConfig(state_dir=str(state_dir), batch_poll_interval_s=0.02, **cfg)
        self.registry = FakeRegistry(cap)
        self.controller = None
        self.tenants = self
        self.all = {n: Tenant(n) for n in ("alice", "bob")}
        self.delay, self.calls, self.peak = delay, [], 0
        self.batches = BatchService(self.config, self.registry, self.all, self.run_internal, False)

    def check_key(self, raw):
        name = raw.headers.get("authorization", "").removeprefix("Bearer ").removesuffix("-key")
        if name not in self.all:
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")
        return self.all[name]

    async def run_internal(self, path, body, tenant):
        self.calls.append(body["prompt"])
        self.registry.busy += 1
        self.peak = max(self.peak, self.registry.busy)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.registry.busy -= 1
        if body["prompt"] == "bad":
            return 400, error_body(400, "bad prompt", "prompt", "bad_prompt")
        if body["prompt"] == "flaky" and self.calls.count("flaky") == 1:
            return 503, error_body(503, "no replica is ready", code="no_replica")
        usage = {"prompt_tokens": 2, "completion_tokens": 1}
        return 200, {
            "object": "text_completion",
            "choices": [{"text": body["prompt"].upper()}],
            "usage": usage,
        }


@contextlib.contextmanager
def stand_in(tmp_path, **kw):
    gw = FakeGateway(tmp_path, **kw)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await gw.batches.start()
        yield
        await gw.batches.stop()

    app = FastAPI(lifespan=lifespan)
    install_error_handlers(app)
    install_batch_routes(app, gw.batches, gw.check_key, gw.config.batch_max_file_bytes)
    with TestClient(app) as http:
        names = [*gw.all, "eve"]
        sdk = {
            n: OpenAI(base_url="http://testserver/v1", api_key=f"{n}-key", http_client=http) for n in names
        }
        yield gw, sdk


def wait_status(client: OpenAI, batch_id: str, statuses: set[str], timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while (b := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, b
        time.sleep(0.02)
    return b


def lines_of(client: OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []


def test_the_sdk_runs_a_batch_retries_transient_errors_and_tenants_see_only_their_own(tmp_path):
    prompts = ["a", "b", "bad", "flaky", "c", "d"]
    with stand_in(tmp_path, cap=4, batch_max_inflight=4, delay=0.01) as (gw, sdk):
        alice, bob = sdk["alice"], sdk["bob"]
        rows = [request(f"r{i}", p) for i, p in enumerate(prompts)]
        f = alice.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
        assert f.purpose == "batch" and f.bytes == len(jsonl(rows))
        b = alice.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="1h", metadata={"job": "t"}
        )
        assert (
            b.status == "in_progress" and b.request_counts.total == 6 and b.expires_at - b.created_at == 3600
        )
        b = wait_status(alice, b.id, {"completed"})
        assert b.request_counts.completed == 5 and b.request_counts.failed == 1 and b.usage.input_tokens == 10
        out = lines_of(alice, b.output_file_id)
        assert [o["custom_id"] for o in out] == ["r0", "r1", "r3", "r4", "r5"]
        assert out[2]["response"]["body"]["choices"][0]["text"] == "FLAKY"
        (err,) = lines_of(alice, b.error_file_id)
        assert err["custom_id"] == "r2" and err["response"]["status_code"] == 400
        assert err["error"]["code"] == "bad_prompt"
        assert gw.calls.count("flaky") == 2 and len(gw.calls) == 7
        # Allowed at most ceil(cap / 2) at once on an idle fleet.
        assert gw.peak <= 2
        # Another tenant's ids do not exist for it.
        for call in (
            lambda: bob.batches.retrieve(b.id),
            lambda: bob.files.retrieve(f.id),
            lambda: bob.files.content(b.output_file_id),
            lambda: bob.batches.cancel(b.id),
            lambda: bob.batches.create(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert [x.id for x in alice.batches.list()] == [b.id] and not list(bob.batches.list())
        assert {x.id for x in alice.files.list()} == {f.id, b.output_file_id, b.error_file_id}
        assert alice.files.delete(f.id).deleted and not list(alice.files.list(purpose="batch"))
        with pytest.raises(openai.AuthenticationError):
            sdk["eve"].batches.list()

        # A bad line fails the whole batch at creation, naming the line.
        bad = alice.files.create(
            file=("bad.jsonl", jsonl([rows[0], {**rows[1], "url": "/v1/x"}])), purpose="batch"
        )
        failed = alice.batches.create(
            input_file_id=bad.id, endpoint="/v1/completions", completion_window="24h"
        )
        assert failed.status == "failed" and failed.failed_at
        assert [(e.line, e.code) for e in failed.errors.data] == [(2, "mismatched_url")]
        with pytest.raises(openai.BadRequestError):
            alice.batches.create(input_file_id=bad.id, endpoint="/v1/moderations", completion_window="24h")
        with pytest.raises(openai.ConflictError):
            alice.batches.cancel(failed.id)


def test_cancel_finishes_running_lines_and_expiry_fails_the_rest(tmp_path):
    with stand_in(tmp_path, cap=4, batch_max_inflight=2, delay=0.2) as (gw, sdk):
        alice = sdk["alice"]
        f = alice.files.create(
            file=("in.jsonl", jsonl(request(f"r{i}", f"p{i}") for i in range(10))), purpose="batch"
        )
        b = alice.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 10
        while not gw.calls:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert alice.batches.cancel(b.id).status == "cancelling"
        b = wait_status(alice, b.id, {"cancelled"})
        assert b.cancelling_at and b.cancelled_at
        counts = b.request_counts
        assert counts.completed == len(gw.calls) >= 1 and counts.completed + counts.failed == 10
        errs = lines_of(alice, b.error_file_id)
        assert {e["error"]["code"] for e in errs} == {"batch_cancelled"} and len(errs) == counts.failed
        ids = [o["custom_id"] for o in lines_of(alice, b.output_file_id)] + [e["custom_id"] for e in errs]
        assert sorted(ids) == sorted(f"r{i}" for i in range(10))

        gw.registry.waiting_now = 1  # interactive requests wait: the batch lane starts nothing
        calls = len(gw.calls)
        f = alice.files.create(
            file=("in.jsonl", jsonl(request(f"e{i}", "x") for i in range(3))), purpose="batch"
        )
        b = alice.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1s")
        b = wait_status(alice, b.id, {"expired"}, timeout=10)
        assert len(gw.calls) == calls and b.output_file_id is None and b.expired_at
        assert b.request_counts.failed == 3
        assert {e["error"]["code"] for e in lines_of(alice, b.error_file_id)} == {"batch_expired"}


def test_batch_share_shrinks_as_interactive_demand_grows(tmp_path):
    gw = FakeGateway(tmp_path, cap=16, batch_max_inflight=4)
    svc = gw.batches
    assert svc.allowed(None) == 4
    gw.registry.busy = 11  # 5 free: 3 of them
    assert svc.allowed(None) == 3
    gw.registry.busy = 15
    assert svc.allowed(None) == 1
    gw.registry.busy = 16  # full, and a replica exists: wait
    assert svc.allowed(None) == 0
    gw.registry.busy, gw.registry.waiting_now = 0, 1  # free slots, but an interactive request waits
    assert svc.allowed(None) == 0
    gw.registry.waiting_now, gw.registry.replicas, gw.registry.cap = 0, {}, 0
    assert svc.allowed(None) == 1  # nothing to measure: one at a time finds out


def test_file_uploads_have_their_own_body_limit():
    async def echo(scope, receive, send):
        size = 0
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                raise RuntimeError("client gone")
            size += len(m.get("body", b""))
            if not m.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})

    app = BodyLimitMiddleware(echo, max_bytes=10, path_limits={"/v1/files": 100})
    c = TestClient(app)  # no lifespan: the stand-in app has none
    assert c.post("/v1/files", content=b"x" * 50).text == "50"
    assert c.post("/v1/files", content=b"x" * 101).status_code == 413
    assert c.post("/v1/filesx", content=b"x" * 50).status_code == 413
    assert c.post("/v1/completions", content=b"x" * 50).status_code == 413

    def chunks():  # no content-length: counted as it streams
        yield b"x" * 60
        yield b"x" * 60

    r = c.post("/v1/files", content=chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


# --- a real fleet ----------------------------------------------------------------------------


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


MODEL = "SmolLM2-135M-Instruct"
FLEET = """
replicas = 1
replica_args = ["--threads", "1", "--kv-cache-memory", "256MiB"]
[gateway]
state_dir = "{state}"
batch_max_inflight = 2
[[tenants]]
name = "alice"
api_key_sha256 = "{alice}"
[[tenants]]
name = "bob"
api_key_sha256 = "{bob}"
"""


def test_a_batch_survives_kill_9_of_the_gateway_with_each_result_once(tmp_path):
    """A chat batch cut by kill -9 of its gateway finishes after a restart, each line once; then,
    on the same fleet, a batch of embeddings."""
    from tests.fleet_helpers import auth, spawn, start_fleet, wait_replicas_ready

    cfg = tmp_path / "fleet.toml"
    cfg.write_text(FLEET.format(state=tmp_path / "state", alice=sha("alice-key"), bob=sha("bob-key")))
    n = 30
    rows = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"{i}+{i}="}],
                "max_tokens": 4,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]
    gw = start_fleet(1, "--config", str(cfg))  # no operator key: fleet routes answer this host
    try:
        alice = OpenAI(base_url=gw.url + "/v1", api_key="alice-key", max_retries=0)
        f = alice.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        b = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while (now := alice.batches.retrieve(b.id)).request_counts.completed < 4:
            assert now.status == "in_progress" and time.monotonic() < deadline, now
            time.sleep(0.05)
        gw.proc.kill()  # kill -9 mid-batch; its replica dies with it
        gw.proc.wait()
        assert now.request_counts.completed < n, "the batch ended before the kill"
        gw = spawn(["fleet", "up", "--config", str(cfg), "--base-port", "0"])
        wait_replicas_ready(gw, 1)
        alice = OpenAI(base_url=gw.url + "/v1", api_key="alice-key", max_retries=0)
        done = wait_status(alice, b.id, {"completed", "failed", "expired", "cancelled"}, timeout=180)
        assert done.status == "completed" and done.request_counts.completed == n, done
        assert "batch lane: resuming 1 batches" in gw.log()
        out = lines_of(alice, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(r["custom_id"] for r in rows)  # once each
        assert done.error_file_id is None
        # The same requests sent interactively answer the same (greedy).
        for o, r in list(zip(out, rows, strict=True))[:: n // 6]:
            assert o["custom_id"] == r["custom_id"]
            live = alice.chat.completions.create(**r["body"])
            assert (
                o["response"]["body"]["choices"][0]["message"]["content"] == live.choices[0].message.content
            )
        # Bob cannot see it.
        bob = OpenAI(base_url=gw.url + "/v1", api_key="bob-key", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(b.id)
        assert gw.get(f"/v1/batches/{b.id}", headers=auth("bob-key")).status_code == 404
        _embeddings_batch_answers_as_the_endpoint(alice)
    finally:
        gw.stop()


def _embeddings_batch_answers_as_the_endpoint(client: OpenAI) -> None:
    """A batch of /v1/embeddings requests: each line's vector is the one the endpoint gives the
    same input interactively."""
    texts = ["a shoal of fish", "the capital of France", "batch lanes run when it is quiet"]
    rows = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": text},
        }
        for i, text in enumerate(texts)
    ]
    f = client.files.create(file=("emb.jsonl", jsonl(rows)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    done = wait_status(client, b.id, {"completed", "failed", "expired", "cancelled"}, timeout=120)
    assert done.status == "completed" and done.request_counts.completed == len(texts), done
    out = {o["custom_id"]: o["response"] for o in lines_of(client, done.output_file_id)}
    for r, text in zip(rows, texts, strict=True):
        assert out[r["custom_id"]]["status_code"] == 200
        vector = out[r["custom_id"]]["body"]["data"][0]["embedding"]
        live = client.embeddings.create(model=MODEL, input=text).data[0].embedding
        assert np.allclose(vector, live, atol=1e-5)
