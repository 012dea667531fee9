"""Prefill/decode disaggregation through a real fleet: one prefill and one decode worker behind the
gateway, the K/V moving between their processes over shared memory and TCP, against HF's greedy
output and against the decode worker computing the prompt itself; then kill -9 of each worker
under load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import torch

from shoal.engine.kv_connector import frames
from shoal.engine.kv_connector.packing import PackedKV
from shoal.engine.kv_connector.transports import ShmTransport, TcpTransport
from shoal.protocol import kv_files
from shoal.protocol.block_hash import hash_blocks, root_hash
from shoal.protocol.secrets import KV_TRANSFER_KEY_HEADER, kv_salt
from tests.cross_host_helpers import wait_idle
from tests.fleet_helpers import metric, replicas, spawn, wait_replicas_ready
from tests.helpers import PROMPTS
from tests.otlp_collector import OTLPCollector

MODEL = "SmolLM2-135M-Instruct"
KEY, SALT = "test-transfer-key", "test-salt"
REPLICA_ARGS = "--kv-cache-memory 256MiB --threads 1 --quantization none --kv-hold-timeout 8"
LONG = (
    "Harbour log, day {n}. The tide came in at dawn and the boats went out past the breakwater, "
    "where the gulls followed them for a while before turning back to the rocks. "
)


@pytest.fixture(scope="module")
def collector():
    """Where the fleet's processes export their spans (OTLP over HTTP)."""
    c = OTLPCollector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def fleet(collector):
    env = {"SHOAL_KV_TRANSFER_KEY": KEY, "SHOAL_KV_SALT": SALT}
    args = ["fleet", "up", "--prefill", "1", "--decode", "1", "--base-port", "0"]
    args += ["--otlp-traces-endpoint", collector.url]
    gw = spawn([*args, "--disagg-min-prompt-tokens", "0", "--replica-args", REPLICA_ARGS], env)
    try:
        wait_replicas_ready(gw, 2)
        yield gw
    finally:
        gw.stop()


def workers(gw) -> tuple[dict, dict]:
    reps = replicas(gw)
    return reps["prefill-0"], reps["decode-1"]


def decisions(gw, decision: str) -> float:
    return metric(gw.url, f'shoal:gateway_disagg_decisions_total{{decision="{decision}"}}')


def shm_left(*pids: int) -> list[str]:
    """K/V files in shared memory written by these processes."""
    names = [p.name for p in kv_files.SHM_DIR.glob(kv_files.SHM_PREFIX + "*")]
    return [n for n in names if (m := kv_files.SHM_NAME.fullmatch(n)) and int(m.group(1)) in pids]


# --- through the gateway -----------------------------------------------------------------


def test_greedy_through_a_prefill_and_a_decode_worker_equals_hf(fleet, reference):
    before = decisions(fleet, "remote")
    for prompt in PROMPTS:
        ids, tokens, _ = reference[prompt]
        body = {"model": MODEL, "prompt": ids, "max_tokens": len(tokens), "temperature": 0}
        r = httpx.post(fleet.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert r.headers["x-replica"] == "decode-1"
        assert out["choices"][0]["token_ids"] == tokens, prompt
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["usage"]["completion_tokens"] == len(tokens)
    assert decisions(fleet, "remote") - before == len(PROMPTS)  # every prompt was computed remotely
    _, decode = workers(fleet)
    assert metric(decode["url"], "shoal:kv_transfer_fallbacks_total") == 0
    assert metric(decode["url"], "shoal:kv_transfer_duration_seconds_count") >= len(PROMPTS)


def test_a_disaggregated_request_is_one_trace_across_the_gateway_and_both_workers(fleet, collector):
    """The client's traceparent is the parent of every span the request makes, in three processes:
    the gateway's (admission and routing, the remote prefill), the prefill worker's (its request
    and engine phases, under the gateway's prefill span), the decode worker's (its request, the
    K/V transfer, its engine phases)."""
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    body = {"model": MODEL, "prompt": LONG.format(n=77), "max_tokens": 8, "temperature": 0}
    headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
    r = httpx.post(fleet.url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text

    def whole(spans) -> bool:
        names = {(s.resource.get("shoal.role"), s.name) for s in spans}
        return {("decode", "engine.decode"), ("prefill", "engine.prefill")} <= names and any(
            s.service == "shoal-gateway" and s.parent_id == client_span for s in spans
        )

    spans = collector.trace(trace_id, whole)
    assert whole(spans), sorted((s.service, s.resource.get("shoal.role"), s.name) for s in spans)

    def one(name: str, service: str, role: str | None = None):
        found = [
            s
            for s in spans
            if s.name == name and s.service == service and s.resource.get("shoal.role") == role
        ]
        assert len(found) == 1, (name, role, [(s.name, s.resource) for s in spans])
        return found[0]

    root = one("POST /v1/completions", "shoal-gateway")
    assert root.parent_id == client_span and root.attributes["http.response.status_code"] == 200
    routes = [s for s in spans if s.name == "gateway.route"]
    assert routes and all(s.parent_id == root.span_id for s in routes)
    assert {s.attributes["shoal.roles"] for s in routes} == {"prefill", "both,decode"}
    prefill_span = one("gateway.prefill", "shoal-gateway")
    assert prefill_span.parent_id == root.span_id and prefill_span.attributes["shoal.prefilled"] is True
    on_prefill = one("POST /v1/completions", "shoal-serve", "prefill")
    assert on_prefill.parent_id == prefill_span.span_id
    on_decode = one("POST /v1/completions", "shoal-serve", "decode")
    assert on_decode.parent_id == root.span_id
    transfer = one("kv.transfer", "shoal-serve", "decode")
    assert transfer.parent_id == on_decode.span_id and transfer.attributes["shoal.bytes"] > 0
    for role, server in (("prefill", on_prefill), ("decode", on_decode)):
        phases = [one(f"engine.{p}", "shoal-serve", role) for p in ("queue", "prefill", "decode")]
        assert all(p.parent_id == server.span_id for p in phases)
        assert (
            server.start_ns <= phases[0].start_ns <= phases[1].start_ns <= phases[2].end_ns <= server.end_ns
        )
    assert one("engine.decode", "shoal-serve", "decode").attributes["shoal.output_tokens"] == 8


def test_a_prompt_the_decode_worker_holds_is_prefilled_there(fleet):
    prompt = LONG.format(n="cached") * 3
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = httpx.post(fleet.url + "/v1/completions", json=body, timeout=60).json()
    local = decisions(fleet, "local_cached")
    again = httpx.post(fleet.url + "/v1/completions", json=body, timeout=60).json()
    assert decisions(fleet, "local_cached") == local + 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


async def _stream(url: str, body: dict) -> tuple[dict, dict | None, str]:
    """A streamed chat's choices (text, logprob tokens, finish reasons), usage and one id."""
    choices: dict[int, dict] = {}
    usage, ids = None, set()
    async with (
        httpx.AsyncClient(timeout=120) as c,
        c.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            ids.add(obj["id"])
            usage = obj.get("usage") or usage
            for ch in obj["choices"]:
                got = choices.setdefault(ch["index"], {"text": "", "tokens": [], "finish": []})
                got["text"] += ch["delta"].get("content") or ""
                got["tokens"] += [t["token"] for t in (ch.get("logprobs") or {}).get("content") or []]
                if ch.get("finish_reason"):
                    got["finish"].append(ch["finish_reason"])
    assert len(ids) == 1  # one stream, one id
    return choices, usage, ids.pop()


def test_n2_logprobs_and_stop_strings_across_the_split_equal_the_decode_worker_alone(fleet):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": LONG.format(n=1) + "What did the gulls do?"}],
        "n": 2,
        "seed": 7,
        "temperature": 0.8,
        "max_tokens": 24,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": [" rocks"],
        "stream_options": {"include_usage": True},
    }
    before = decisions(fleet, "remote")
    split, usage, _ = asyncio.run(_stream(fleet.url, body))
    assert decisions(fleet, "remote") == before + 1
    _, decode = workers(fleet)
    alone, alone_usage, _ = asyncio.run(_stream(decode["url"], body))  # the prompt computed there
    assert split == alone
    assert usage["prompt_tokens"] == alone_usage["prompt_tokens"]
    assert usage["completion_tokens"] == alone_usage["completion_tokens"]
    assert usage["completion_tokens"] == sum(len(c["tokens"]) for c in split.values())
    assert all(len(c["finish"]) == 1 for c in split.values())


def test_an_aborted_stream_frees_both_workers(fleet):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": LONG.format(n="abort") * 2}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }

    async def go():
        async with (
            httpx.AsyncClient(timeout=60) as c,
            c.stream("POST", fleet.url + "/v1/chat/completions", json=body) as r,
        ):
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n >= 5:
                    break  # the client goes away mid-stream

    asyncio.run(go())
    for w in workers(fleet):
        wait_idle(w["url"])
    assert not shm_left(*(w["pid"] for w in workers(fleet)))


def test_kv_transfer_params_are_the_fleets_alone(fleet):
    prefill, decode = workers(fleet)
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 2}
    r = httpx.post(
        fleet.url + "/v1/completions", json={**body, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    for url, kv in (
        (prefill["url"], {"do_remote_decode": True}),
        (decode["url"], {"source": prefill["url"], "handle": "x"}),
    ):
        r = httpx.post(url + "/v1/completions", json={**body, "kv_transfer_params": kv}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "kv_transfer_forbidden"
        r = httpx.post(url + "/kv/pull", json={"handle": "x", "transport": "tcp"}, timeout=30)
        assert r.status_code == 403
    wrong = {KV_TRANSFER_KEY_HEADER: "not-the-key"}
    r = httpx.post(prefill["url"] + "/kv/release", json={"handle": "x"}, headers=wrong, timeout=30)
    assert r.status_code == 403


# --- the transfer itself -----------------------------------------------------------------


def _prefill(prefill_url: str, prompt: str) -> tuple[dict, list[int]]:
    r = httpx.post(
        prefill_url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        headers={KV_TRANSFER_KEY_HEADER: KEY},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    tok = httpx.post(prefill_url + "/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=30).json()
    return r.json()["kv_transfer_params"], tok["tokens"]


def _pull(prefill_url: str, handle: str, transport: str) -> PackedKV:
    r = httpx.post(
        prefill_url + "/kv/pull",
        json={"handle": handle, "transport": transport},
        headers={KV_TRANSFER_KEY_HEADER: KEY},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    if transport == "shm":
        return ShmTransport().receive(r.json())
    return TcpTransport().receive(bytearray(r.content))


def test_the_kv_that_arrives_is_what_prefill_computed_per_block(fleet, bundled):
    """Both transports deliver the same bytes; each block matches an independent prefill of the
    prompt (this process's own model) and carries the hash the decode side expects."""
    from shoal.engine.config import CacheConfig, EngineConfig
    from shoal.engine.llm_engine import LLMEngine
    from shoal.engine.sampling_params import SamplingParams

    prefill, _ = workers(fleet)
    prompt = LONG.format(n="blocks") * 2
    params, ids = _prefill(prefill["url"], prompt)
    assert httpx.get(prefill["url"] + "/load").json()["kv_held"] == 1
    shm = _pull(prefill["url"], params["handle"], "shm")
    tcp = _pull(prefill["url"], params["handle"], "tcp")
    assert torch.equal(shm.data, tcp.data) and shm.block_hashes == tcp.block_hashes
    assert shm.num_tokens == len(ids) and tcp.data.shape[2] == len(ids)
    block = 16
    assert shm.block_hashes == hash_blocks(ids, block, root=root_hash(kv_salt(SALT)))[: len(ids) // block]
    # Released before the local prefill below, which on a loaded machine can outlast the hold.
    r = httpx.post(
        prefill["url"] + "/kv/release",
        json={"handle": params["handle"]},
        headers={KV_TRANSFER_KEY_HEADER: KEY},
    )
    assert r.json() == {"released": True}

    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64)), loaded=bundled)
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=1), hold_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    local = engine.core.export_kv("r")
    for b in range(0, len(ids), block):
        got, want = shm.data[:, :, b : b + block], local.data[:, :, b : b + block]
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"block {b // block}"
    wait_idle(prefill["url"])
    assert not shm_left(prefill["pid"])


def test_frames_that_do_not_parse_are_refused():
    packed = PackedKV(3, [5], torch.arange(2 * 2 * 3 * 1 * 4, dtype=torch.float32).reshape(2, 2, 3, 1, 4))
    frame = frames.encode(packed)
    assert torch.equal(frames.decode(bytearray(frame)).data, packed.data)
    for bad in (frame[:-4], frame[:3], b"\xff\xff\xff\x7f" + frame[4:], frame + b"x"):
        with pytest.raises(frames.TransferError):
            frames.decode(bytearray(bad))
    for name in (
        "../etc/passwd",
        "shoal-kv-1-zz",
        "shoal-kv-1-" + "0" * 31,
        "/dev/shm/shoal-kv-1-" + "0" * 32,
    ):
        with pytest.raises(frames.TransferError):
            ShmTransport().receive({"name": name})


# --- kill -9 under load ------------------------------------------------------------------


async def _load(url: str, n: int, tag: str, repeat: int, max_tokens: int = 48) -> list[dict]:
    async def one(i: int):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": LONG.format(n=f"{tag}-{i}") * repeat + " Summarize."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "stream_options": {"include_usage": True},
        }
        choices, usage, _ = await _stream(url, body)
        return {"choices": choices, "usage": usage}

    return await asyncio.gather(*(one(i) for i in range(n)))


def _kill_when(pid: int, ready, sig: int = signal.SIGKILL) -> None:
    while not ready():
        time.sleep(0.02)
    os.kill(pid, sig)


def test_killing_the_prefill_then_the_decode_worker_under_load_fails_nothing(fleet):
    def busy(url: str) -> bool:
        load = httpx.get(url + "/load", timeout=5).json()
        return load["running"] + load["waiting"] > 0

    async def round_(tag: str, victim: dict, ready):
        load = asyncio.create_task(_load(fleet.url, 6, tag, 12 if tag == "p" else 3))
        await asyncio.to_thread(_kill_when, victim["pid"], ready)
        return await load

    prefill, decode = workers(fleet)
    tokens0 = metric(decode["url"], "shoal:generation_tokens_total")
    rounds = (
        ("p", prefill, lambda: busy(prefill["url"])),  # mid-way through the prefills
        ("d", decode, lambda: metric(decode["url"], "shoal:generation_tokens_total") > tokens0 + 30),
    )
    for tag, victim, ready in rounds:
        results = asyncio.run(round_(tag, victim, ready))
        for res in results:  # every request whole: its tokens, one finish, usage
            (c,) = res["choices"].values()
            assert len(c["tokens"]) == 48 and c["finish"] == ["length"], c
            assert res["usage"]["completion_tokens"] == 48
        wait_replicas_ready(fleet, 2, timeout=120)
        if tag == "p":
            tokens0 = metric(decode["url"], "shoal:generation_tokens_total")
    assert metric(fleet.url, "shoal:gateway_failovers_total") >= 1  # the decode worker's streams moved
    # Requests the dead prefill worker had not finished (or whose K/V it still held) were computed
    # on the decode worker instead.
    fell_back = [
        decisions(fleet, "local_no_prefill_worker"),
        decisions(fleet, "local_prefill_failed"),
        metric(workers(fleet)[1]["url"], "shoal:kv_transfer_fallbacks_total"),
    ]
    assert sum(fell_back) >= 1, fell_back
    for w in workers(fleet):
        wait_idle(w["url"])
    assert not shm_left(prefill["pid"], decode["pid"], *(w["pid"] for w in workers(fleet)))


def test_a_stalled_prefill_worker_delays_requests_by_a_bounded_time(fleet):
    """SIGSTOP of the prefill worker mid-way through its prompts: the gateway's probes mark it down,
    which interrupts its prefills, and the decode worker computes those prompts itself."""
    prefill, _ = workers(fleet)
    failed0 = decisions(fleet, "local_prefill_failed") + decisions(fleet, "local_no_prefill_worker")

    def busy() -> bool:
        load = httpx.get(prefill["url"] + "/load", timeout=5).json()
        return load["running"] + load["waiting"] > 0

    async def go():
        load = asyncio.create_task(_load(fleet.url, 4, "stall", 12))
        t0 = time.monotonic()
        await asyncio.to_thread(_kill_when, prefill["pid"], busy, signal.SIGSTOP)
        try:
            return await load, time.monotonic() - t0
        finally:
            os.kill(prefill["pid"], signal.SIGCONT)

    results, took = asyncio.run(go())
    for res in results:
        (c,) = res["choices"].values()
        assert len(c["tokens"]) == 48 and c["finish"] == ["length"], c
    assert decisions(fleet, "local_prefill_failed") + decisions(fleet, "local_no_prefill_worker") > failed0
    assert took < 60, took  # probes (about 2 s) and the local prefills, not the 30 s prefill timeout
    wait_replicas_ready(fleet, 2, timeout=60)
    for w in workers(fleet):
        wait_idle(w["url"])
