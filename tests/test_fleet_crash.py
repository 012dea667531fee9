"""Real crashes under a real fleet: kill -9 of replicas mid-stream (chat, logprobs, n=2 seeded),
poison requests that crash the engine they run on (the replicas' SHOAL_FAULT_CRASH_ON hook), and
kill -9 of `fleet up` itself."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from tests.fleet_helpers import FLEET_KEY as KEY
from tests.fleet_helpers import POISON_MARKER, auth, metric, replicas, spawn, start_fleet, wait_replicas_ready
from tests.server_helpers import free_port

REPLICA_ARGS = "--kv-cache-memory 256MiB --threads 1"
MODEL = "SmolLM2-135M-Instruct"
MARKER = POISON_MARKER


@pytest.fixture(scope="module")
def fleet(shared_fleet):
    """Three replicas behind a key whose engines crash on MARKER (see conftest), shared with
    test_fleet and test_fleet_hardening."""
    return shared_fleet


async def collect(url: str, path: str, body: dict, kill_after: int | None = None, pids=None):
    """Streams a request; returns (choices by index, usage, chunks, x-replica). With `kill_after`,
    kills -9 the replica serving it once that many content chunks have arrived."""
    choices: dict[int, dict] = {}
    usage, chunks, roles = None, [], []
    async with (
        httpx.AsyncClient(timeout=300, headers=auth(KEY)) as c,
        c.stream("POST", url + path, json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200, await r.aread()
        replica = r.headers["x-replica"]
        content = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            chunks.append(obj)
            if "error" in obj:
                break
            usage = obj.get("usage") or usage
            for ch in obj["choices"]:
                got = choices.setdefault(ch["index"], {"text": "", "logprobs": [], "finish": []})
                delta = ch.get("delta") or {}
                if "role" in delta:
                    roles.append(ch["index"])
                text = delta.get("content") if "delta" in ch else ch.get("text")
                got["text"] += text or ""
                content += bool(text)
                lp = ch.get("logprobs")
                if lp:
                    got["logprobs"] += lp["content"] if "content" in lp else lp["tokens"]
                if ch.get("finish_reason"):
                    got["finish"].append(ch["finish_reason"])
            if kill_after is not None and content >= kill_after:
                os.kill(pids[replica], signal.SIGKILL)
                kill_after = None
    return choices, usage, chunks, roles, replica


def assert_same(got: dict, expected: dict) -> None:
    """The same choices: text, finish reasons, logprob tokens and alternatives exactly, logprob
    values to float precision (the continuation computes the resumed tokens' logits in a prefill,
    the uninterrupted run in decode steps)."""
    assert sorted(got) == sorted(expected)
    for i, want in expected.items():
        have = got[i]
        assert have["text"] == want["text"], i
        assert have["finish"] == want["finish"], i
        assert len(have["logprobs"]) == len(want["logprobs"]), i
        for a, b in zip(have["logprobs"], want["logprobs"]):
            assert a["token"] == b["token"] and a["bytes"] == b["bytes"]
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-3)
            alts_a, alts_b = a.get("top_logprobs") or [], b.get("top_logprobs") or []
            assert [t["token"] for t in alts_a] == [t["token"] for t in alts_b]
            assert [t["logprob"] for t in alts_a] == pytest.approx([t["logprob"] for t in alts_b], abs=1e-3)


def pids_of(gw, key: str | None = KEY) -> dict[str, int]:
    return {name: r["pid"] for name, r in replicas(gw, key).items()}


def tokens_of(usage: dict) -> tuple:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


# --- continuation after kill -9 -------------------------------------------------------------


def test_a_chat_stream_without_max_tokens_survives_kill_9_with_its_logprobs(fleet):
    body = {
        "model": MODEL,
        # Greedy int4 (the default) ends this answer itself, after 199 tokens.
        "messages": [{"role": "user", "content": "Describe a rainy day in the city."}],
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    expected, exp_usage, _, _, _ = asyncio.run(collect(fleet.url, "/v1/chat/completions", body))
    assert expected[0]["finish"] == ["stop"] and exp_usage["completion_tokens"] > 40
    failovers = metric(fleet.url, "shoal:gateway_failovers_total")
    pids = pids_of(fleet)
    got, usage, chunks, roles, victim = asyncio.run(
        collect(fleet.url, "/v1/chat/completions", body, kill_after=12, pids=pids)
    )
    assert not any("error" in c for c in chunks), chunks[-1]
    assert_same(got, expected)  # text, finish_reason and every logprob, as if nothing had happened
    assert tokens_of(usage) == tokens_of(exp_usage)
    assert roles == [0] and len({c["id"] for c in chunks}) == 1  # one stream, one role chunk
    assert metric(fleet.url, "shoal:gateway_failovers_total") == failovers + 1
    wait_replicas_ready(fleet, 3, api_key=KEY)
    assert pids_of(fleet)[victim] != pids[victim]  # restarted


def test_a_seeded_n2_chat_stream_survives_kill_9(fleet):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "How do I boil an egg?"}],
        "temperature": 0.8,
        "seed": 7,
        "n": 2,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    expected, exp_usage, _, _, _ = asyncio.run(collect(fleet.url, "/v1/chat/completions", body))
    assert sorted(expected) == [0, 1] and all(c["finish"] == ["stop"] for c in expected.values())
    pids = pids_of(fleet)
    got, usage, chunks, roles, _ = asyncio.run(
        collect(fleet.url, "/v1/chat/completions", body, kill_after=30, pids=pids)
    )
    assert not any("error" in c for c in chunks), chunks[-1]
    assert_same(got, expected)
    assert tokens_of(usage) == tokens_of(exp_usage)
    assert sorted(roles) == [0, 1] and len({c["id"] for c in chunks}) == 1
    wait_replicas_ready(fleet, 3, api_key=KEY)


# --- poison requests ------------------------------------------------------------------------


def test_a_poison_request_fails_once_and_takes_down_one_replica(fleet):
    wait_replicas_ready(fleet, 3, api_key=KEY)
    poisoned = metric(fleet.url, "shoal:gateway_poison_requests_total")
    pids = pids_of(fleet)
    poison = {"model": MODEL, "messages": [{"role": "user", "content": f"Say {MARKER} please"}]}
    _, _, chunks, _, _ = asyncio.run(collect(fleet.url, "/v1/chat/completions", poison))
    assert chunks[-1]["error"]["code"] == "poison_request", chunks[-1]
    # Refused at the door from now on, streamed or not, without touching a replica.
    sent = sum(r["requests_total"] for r in replicas(fleet, KEY).values())
    r = httpx.post(fleet.url + "/v1/chat/completions", json=poison, headers=auth(KEY), timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "poison_request"
    assert sum(r["requests_total"] for r in replicas(fleet, KEY).values()) == sent
    # The fleet keeps serving while the one victim restarts.
    ok = httpx.post(
        fleet.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers=auth(KEY),
        timeout=60,
    )
    assert ok.status_code == 200
    _one_died_and_restarted(fleet, pids)
    # A different poison, not streamed: a 500 at once, and again one replica down at most.
    pids = pids_of(fleet)
    r = httpx.post(
        fleet.url + "/v1/completions",
        json={"model": MODEL, "prompt": f"Repeat {MARKER} twice", "max_tokens": 8},
        headers=auth(KEY),
        timeout=60,
    )
    assert r.status_code == 500 and r.json()["error"]["code"] == "poison_request", r.text
    assert metric(fleet.url, "shoal:gateway_poison_requests_total") == poisoned + 2
    _one_died_and_restarted(fleet, pids)  # and it restarts the dead one


def _one_died_and_restarted(fleet, pids: dict[str, int]) -> None:
    """Waits for one of the replicas to exit and for the fleet to restart it; the others stay up
    all the while (their processes are the ones from before)."""
    deadline = time.monotonic() + 30
    while not any(_gone(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    dead = [name for name, p in pids.items() if _gone(p)]
    assert len(dead) == 1, dead
    deadline = time.monotonic() + 240
    while True:
        reps = replicas(fleet, KEY)
        if reps[dead[0]]["pid"] != pids[dead[0]] and all(r["state"] == "ready" for r in reps.values()):
            break
        assert time.monotonic() < deadline, reps
        time.sleep(0.25)
    survivors = {name: p for name, p in pids.items() if name not in dead}
    assert not any(_gone(p) for p in survivors.values())
    assert {name: reps[name]["pid"] for name in survivors} == survivors


# --- the supervisor itself ------------------------------------------------------------------


def _free_run(n: int) -> int:
    """A base port with n free ports from it."""
    for _ in range(50):
        base = free_port()
        if base + n < 65535 and all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):  # reaped before or while /proc was read
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_replicas_die_with_a_killed_fleet_and_a_new_fleet_starts_clean():
    base = _free_run(2)
    args = ("--replica-args", REPLICA_ARGS, "--base-port", str(base))
    gw = start_fleet(2, *args)
    try:
        pids = list(pids_of(gw, None).values())
        gw.proc.kill()  # kill -9: no chance to stop its replicas
        gw.proc.wait()
        deadline = time.monotonic() + 5
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
    finally:
        gw.stop()
        for p in pids:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)
    again = start_fleet(2, *args)
    try:
        reps = replicas(again)
        assert sorted(r["url"] for r in reps.values()) == [f"http://127.0.0.1:{base + i}" for i in range(2)]
        assert not set(pids) & {r["pid"] for r in reps.values()}
        r = httpx.post(
            again.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200
    finally:
        again.stop()


class Stranger:
    """Some other server that took a replica's port: it answers every probe as healthy."""

    def __init__(self, port: int):
        app = FastAPI()

        @app.get("/health")
        @app.get("/ready")
        async def fine():
            return {"status": "ok"}

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


def test_a_busy_port_is_never_started_on_nor_called_ready(fleet):
    base = _free_run(1)
    stranger = Stranger(base)
    try:  # at startup: fail fast, saying why
        gw = spawn(["fleet", "up", "--replicas", "1", "--base-port", str(base)])
        assert gw.proc.wait(60) == 1
        assert f"port {base} already in use" in gw.log()
    finally:
        stranger.close()
    # At a restart: the replica waits, marked port_in_use, and the stranger is never "ready".
    wait_replicas_ready(fleet, 3, api_key=KEY)
    victim = replicas(fleet, KEY)["replica-0"]
    pid, port = victim["pid"], int(victim["url"].rsplit(":", 1)[1])
    os.kill(pid, signal.SIGKILL)
    while _free(port) is False:
        time.sleep(0.01)
    stranger = Stranger(port)
    try:
        while replicas(fleet, KEY)["replica-0"]["state"] == "ready":  # until the supervisor saw the death
            time.sleep(0.02)
        # Its restart waits out a backoff first, longer if this shared fleet's replica-0 died
        # quickly in earlier tests (up to restart_backoff_max_s): until then it shows "down".
        deadline = time.monotonic() + 45
        states = set()
        rep = replicas(fleet, KEY)["replica-0"]
        while rep["state"] != "port_in_use" and time.monotonic() < deadline:
            states.add(rep["state"])
            time.sleep(0.1)
            rep = replicas(fleet, KEY)["replica-0"]
        watch_until = time.monotonic() + 4  # and it stays so while the stranger holds the port
        while time.monotonic() < watch_until:
            rep = replicas(fleet, KEY)["replica-0"]
            states.add(rep["state"])
            time.sleep(0.1)
        assert rep["state"] == "port_in_use" and "in use" in rep["note"], rep
        assert "ready" not in states, states
    finally:
        stranger.close()
    reps = {r["name"]: r for r in wait_replicas_ready(fleet, 3, timeout=120, api_key=KEY)}
    assert reps["replica-0"]["pid"] != pid and reps["replica-0"]["restarts"] >= 1
    assert reps["replica-0"]["url"] == victim["url"]  # back on its own port
    # What the stranger answered (a 404 for /load) is forgotten: the new process's load is polled.
    deadline = time.monotonic() + 10
    while "running" not in replicas(fleet, KEY)["replica-0"]["load"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "running" in replicas(fleet, KEY)["replica-0"]["load"], replicas(fleet, KEY)["replica-0"]


def test_non_streamed_requests_go_on_elsewhere_when_their_replica_is_killed(fleet):
    """Relayed as streams (fleet/proxy/fold.py), they continue from where they were, not from the
    start: each answer, seeded sampling and logprobs included, is the uninterrupted one."""
    wait_replicas_ready(fleet, 3, api_key=KEY)
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0.8, "logprobs": 1, "ignore_eos": True}
    prompts = [f"Tell me about river number {i}." for i in range(4)]

    def request(i: int) -> dict:
        return {**body, "prompt": prompts[i], "seed": 100 + i}

    async def alone():  # seeded draws do not depend on the batch: all at once
        async with httpx.AsyncClient(timeout=120, headers=auth(KEY)) as c:
            answers = await asyncio.gather(
                *(c.post(fleet.url + "/v1/completions", json=request(i)) for i in range(4))
            )
        return [r.json()["choices"] for r in answers]

    expected = asyncio.run(alone())
    failovers = metric(fleet.url, "shoal:gateway_failovers_total")

    async def run():
        async with httpx.AsyncClient(timeout=300, headers=auth(KEY)) as c:
            tasks = [
                asyncio.create_task(c.post(fleet.url + "/v1/completions", json=request(i))) for i in range(4)
            ]
            while True:  # kill the replica holding the most of them, once they run
                busy = max(replicas(fleet, KEY).values(), key=lambda r: r["inflight"])
                if busy["load"].get("running", 0) >= 1 and busy["inflight"] >= 1:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            os.kill(busy["pid"], signal.SIGKILL)
            return busy["name"], await asyncio.gather(*tasks)

    killed, answers = asyncio.run(run())
    for i, r in enumerate(answers):
        assert r.status_code == 200, r.text
        assert r.json()["choices"] == expected[i]
    assert metric(fleet.url, "shoal:gateway_failovers_total") > failovers  # continued, not run again
    # x-replica names every replica whose tokens an answer holds, in order: the killed one first.
    names = [r.headers["x-replica"].split(", ") for r in answers]
    assert any(len(n) == 2 and n[0] == killed for n in names), names
    assert all(len(set(n)) == len(n) for n in names), names
    wait_replicas_ready(fleet, 3, api_key=KEY)
