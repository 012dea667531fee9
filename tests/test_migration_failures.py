"""Live migration when a side fails: two replicas of the bundled model behind a gateway.

A stream is moved in two phases: its context is copied to the target while it goes on decoding
on its source, then it switches. A target whose engine dies during the copy leaves the stream
running on its source, which finishes it exactly; a source killed while its streams move leaves
each to finish on the target (switched, or continued as after any death), every one exactly.
Neither side is left holding a request or a KV block."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest

from shoal.protocol.secrets import KV_TRANSFER_KEY_ENV
from tests.fleet_helpers import auth, metric, start_gateway
from tests.server_helpers import sse_objects, start_server, start_servers

KEY = "sk-migration-failures"
MODEL = "SmolLM2-135M-Instruct"
ARGS = ("--api-key", KEY, "--kv-cache-memory", "128MiB", "--threads", "1")
MARKER = "the harbour master's ledger"  # the target's engine dies on a prompt holding it
PROMPT = f"Notes from {MARKER}: ships came and went all through the long summer. " * 12


@pytest.fixture
def transfer_key(monkeypatch):
    monkeypatch.setenv(KV_TRANSFER_KEY_ENV, "migration-failures-transfer-key")


def body(i: int, prompt: str = PROMPT) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 40,
        "temperature": 0.9,
        "seed": 100 + i,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 1,
        "return_token_ids": True,
    }


def stream(url: str, req: dict, on_event=None) -> tuple[list[int], str, str]:
    """The stream's token ids and text, and the replica that answered first."""
    ids, text = [], ""
    with httpx.stream("POST", url + "/v1/completions", json=req, headers=auth(KEY), timeout=120) as r:
        assert r.status_code == 200, r.read()
        replica = r.headers.get("x-replica", "")
        for n, obj in enumerate(sse_objects(r), 1):
            assert "error" not in obj, obj
            for ch in obj.get("choices") or []:
                ids += ch.get("token_ids") or []
                text += ch.get("text") or ""
            if on_event is not None:
                on_event(n, replica)
    return ids, text, replica


def migrate(gw, replica: str) -> int:
    moved = httpx.post(gw.url + "/fleet/migrate", json={"replica": replica}, headers=auth(KEY), timeout=30)
    assert moved.status_code == 200, moved.text
    return moved.json()["moved"]


def test_a_target_that_dies_during_the_copy_leaves_the_stream_on_its_source(transfer_key, monkeypatch):
    source = start_server(*ARGS)
    monkeypatch.setenv("SHOAL_FAULT_CRASH_ON", MARKER)
    target = start_server(*ARGS)
    monkeypatch.delenv("SHOAL_FAULT_CRASH_ON")
    gw = None
    try:
        gw = start_gateway([source.url, target.url], "--policy", "round_robin", api_key=KEY)
        want = stream(source.url, body(0))[:2]  # straight from the source

        def move_once(n: int, replica: str) -> None:
            if n == 5:
                assert replica == "backend-0"
                assert migrate(gw, replica) == 1

        got = stream(gw.url, body(0), move_once)
        assert got[:2] == want
        assert metric(gw.url, 'shoal:gateway_migrations_total{outcome="target_failed"') == 1
        assert metric(gw.url, 'shoal:gateway_migrations_total{outcome="ok"') == 0
        assert metric(gw.url, "shoal:gateway_failovers_total") == 0
        assert not target_ready(target)  # the copy did reach it
        source.wait_idle()  # nothing held there: the stream ended where it ran
    finally:
        for p in [gw, source, target]:
            if p is not None:
                p.stop()


def target_ready(server) -> bool:
    try:
        return httpx.get(server.url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_source_killed_while_its_streams_move_loses_nothing(transfer_key):
    source, target = start_servers(list(ARGS), list(ARGS))
    gw = None
    try:
        gw = start_gateway([source.url, target.url], "--policy", "round_robin", api_key=KEY)
        prompt = "A sailor's diary, written at sea over many weeks of calm and storm. " * 12
        wants = [stream(gw.url, body(i, prompt))[:2] for i in range(4)]
        started = threading.Barrier(5)

        def on_event(n: int, replica: str) -> None:
            if n == 3:
                started.wait(60)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, gw.url, body(i, prompt), on_event) for i in range(4)]
            started.wait(60)  # every stream is decoding: two on each replica
            moving = migrate(gw, "backend-0")
            source.proc.kill()  # while the copies fetch the context from it
            got = [f.result(timeout=120) for f in futures]
        assert moving == 2
        for (ids, text, _), want in zip(got, wants, strict=True):
            assert (ids, text) == want
        target.wait_idle()  # what the copies and continuations took there is free again
    finally:
        for p in [gw, source, target]:
            if p is not None:
                p.stop()
