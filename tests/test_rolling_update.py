"""`shoal fleet update` on a real fleet: a rolling update under continuous streaming load replaces
every replica one at a time with no failed request and every stream whole (long generations,
streamed or not, move off the replicas it drains, their K/V with them, instead of holding it
up); a version that fails to load is rolled back while the old replicas go on serving, and so
is a canary that loads and stays up but fails the requests it is sent; `shoal fleet status` shows it."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from shoal.fleet.control.canary_judge import CanaryConfig, Tally, judge
from tests.fleet_helpers import metric, replicas, start_fleet

REPLICA_ARGS = "--threads 1 --kv-cache-memory 256MiB"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    # Two cores carry the surge replica beside the two old ones, the gateway and the clients, so
    # the surge shares a core: a version as fast as the old one has shown p99 gaps 1.7x and 2.4x
    # the old's here (the second holding the long streams moved off the drained replicas). The
    # bounds are widened to 3x so that the tests of what an update does are not decided by that
    # noise, and the slow version below is slower by far; the judge's 1.5x default has its own test.
    config = tmp_path_factory.mktemp("rollout") / "fleet.toml"
    config.write_text("[rollout]\nmax_ttft_p99_ratio = 3.0\nmax_itl_p99_ratio = 3.0\n")
    gw = start_fleet(2, "--replica-args", REPLICA_ARGS, "--config", str(config))
    yield gw
    gw.stop()


def shoal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shoal.cli", *args], capture_output=True, text=True, timeout=60
    )


def pool(gw) -> dict:
    (p,) = gw.get("/replicas").json()["pools"]
    return p


def wait_for(gw, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert gw.proc.poll() is None, gw.log()
        assert time.monotonic() < deadline, f"timed out: {pool(gw)}"
        time.sleep(0.2)


async def stream_once(c: httpx.AsyncClient, url: str, i: int, tokens: int = 24) -> dict:
    body = {
        "model": MODEL,
        "prompt": f"Story {i}: once upon a time",
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, finish, usage = "", [], None
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "why": f"HTTP {r.status_code}: {(await r.aread())[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return {"ok": False, "why": obj["error"]}
            usage = obj.get("usage") or usage
            for ch in obj["choices"]:
                text += ch.get("text") or ""
                if ch.get("finish_reason"):
                    finish.append(ch["finish_reason"])
    whole = finish == ["length"] and usage is not None and usage["completion_tokens"] == tokens
    return {"ok": whole, "why": f"finish {finish}, usage {usage}", "ended": time.monotonic()}


async def load_until(url: str, done, clients: int = 3, at_least: int = 2) -> list[dict]:
    """Streams from `clients` clients until `done()`, each sending `at_least` requests anyway (an
    update that fails fast may be over before the first one)."""
    results: list[dict] = []

    async def client(k: int):
        async with httpx.AsyncClient(timeout=120) as c:
            i = 0
            while i < at_least or not done():
                results.append(await stream_once(c, url, 1000 * k + i))
                i += 1

    await asyncio.gather(*(client(k) for k in range(clients)))
    return results


async def unary_once(c: httpx.AsyncClient, url: str, i: int, tokens: int) -> dict:
    body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": tokens}
    body["ignore_eos"] = True
    r = await c.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        return {"ok": False, "why": f"HTTP {r.status_code}: {r.text[:200]}"}
    (choice,), usage = r.json()["choices"], r.json()["usage"]
    whole = choice["finish_reason"] == "length" and usage["completion_tokens"] == tokens
    return {"ok": whole, "why": f"finish {choice['finish_reason']}, usage {usage}", "ended": time.monotonic()}


async def long_requests(url: str, tokens: int) -> list[dict]:
    """A long stream and a long non-streamed request (both can move)."""
    async with httpx.AsyncClient(timeout=300) as c:
        return await asyncio.gather(stream_once(c, url, 500, tokens), unary_once(c, url, 501, tokens))


def test_a_rolling_update_under_streaming_load_fails_no_request(fleet):
    """Long generations in flight, streamed or not, do not hold the drains back: each moves, its
    K/V with it, to a replica that stays, and the update is over long before they are."""
    before = {r["name"]: r["pid"] for r in replicas(fleet).values()}

    done_at: list[float] = []

    async def watch() -> None:  # the update's end, to a tenth of a second
        while not done_at:
            p = await asyncio.to_thread(pool, fleet)
            over = set(p["versions"].values()) == {1} or p["last_update"] == "rolled_back"
            if not p["updating"] and over:
                done_at.append(time.monotonic())  # (a rollback fails the checks below, not a timeout)
            await asyncio.sleep(0.1)

    async def load() -> tuple[list[dict], list[dict]]:
        # Long enough to outlast two replica starts and two drains on a slow day: 1200 tokens
        # once ended 0.7 s before the update did (the starts and the decoding slow down alike).
        long = asyncio.ensure_future(long_requests(fleet.url, 1600))
        await asyncio.sleep(1.0)  # decoding, one on each replica
        flags = "--threads 1 --kv-cache-memory 192MiB"
        update = ("fleet", "update", "--gateway", fleet.url, "--replica-args", flags)
        out = await asyncio.to_thread(shoal, *update)
        assert out.returncode == 0, out.stderr
        assert pool(fleet)["updating"]
        watcher = asyncio.ensure_future(watch())
        results = await load_until(fleet.url, lambda: bool(done_at))
        await watcher
        return results, await long

    results, long = asyncio.run(load())
    bad = [r for r in results + long if not r["ok"]]
    assert len(results) >= 10 and not bad, bad[:3]
    assert all(r["ended"] > done_at[0] for r in long), (done_at, long)  # the drains did not wait
    assert metric(fleet.url, 'shoal:gateway_migrations_total{outcome="ok"') >= 2
    assert metric(fleet.url, "shoal:gateway_failovers_total") == 0  # nothing was computed again
    reps = replicas(fleet)
    assert len(reps) == 2 and not set(before) & set(reps)  # every replica replaced, by new ones
    for r in reps.values():
        assert r["lifecycle"] == "ready" and r["version"] == 1
        assert httpx.get(r["url"] + "/load").json()["num_blocks"] < 2000  # the new flags took effect
    assert pool(fleet)["last_update"] == "done"
    judged = pool(fleet)["judgement"]  # judged throughout, on errors and latency, and passed
    assert judged["decision"] == "promoted" and judged["verdict"] is None, judged
    assert judged["new"]["requests"] > 0 and judged["old"]["requests"] > 0
    assert metric(fleet.url, 'shoal:gateway_rolling_updates_total{outcome="done",pool="default"}') == 1
    status = shoal("fleet", "status", "--gateway", fleet.url)
    assert status.returncode == 0 and "version 1" in status.stdout and "ready" in status.stdout
    assert "promoted: new " in status.stdout  # the figures it was promoted on


def test_a_version_that_fails_to_load_is_rolled_back(fleet):
    before = {r["name"]: r["pid"] for r in replicas(fleet).values()}
    out = shoal("fleet", "update", "--gateway", fleet.url, "--model", "/nonexistent/model.gguf")
    assert out.returncode == 0, out.stderr
    again = shoal("fleet", "update", "--gateway", fleet.url, "--replica-args", "--threads 1")
    assert again.returncode == 1 and "in progress" in again.stderr  # one update at a time

    def back() -> bool:
        p = pool(fleet)
        return not p["updating"] and p["last_update"] == "rolled_back"

    results = asyncio.run(load_until(fleet.url, back, clients=2))
    assert results and all(r["ok"] for r in results)
    after = {r["name"]: r["pid"] for r in replicas(fleet).values()}
    assert after == before  # the old replicas never stopped
    assert pool(fleet)["version"] == 1
    assert metric(fleet.url, 'shoal:gateway_rolling_updates_total{outcome="rolled_back",pool="default"}') == 1


def test_a_canary_that_fails_its_requests_is_rolled_back(fleet):
    # A real version that loads, answers every probe and never dies, but sheds every request it
    # is sent (503): the gateway fails each over, so only the tally of its requests can tell.
    rolled_back = 'shoal:gateway_rolling_updates_total{outcome="rolled_back",pool="default"}'
    version, before = pool(fleet)["version"], metric(fleet.url, rolled_back)
    shed = REPLICA_ARGS + " --max-waiting-requests 0"
    out = shoal("fleet", "update", "--gateway", fleet.url, "--replica-args", shed, "--canary", "0.5")
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 240  # the old code promotes it after the canary's 30 s instead

    def back() -> bool:
        p = pool(fleet)
        return (not p["updating"] and p["last_update"] == "rolled_back") or time.monotonic() > deadline

    asyncio.run(load_until(fleet.url, back, clients=3))
    p = pool(fleet)
    assert p["last_update"] == "rolled_back" and p["version"] == version, p
    assert pool(fleet)["judgement"]["verdict"].startswith("the new version failed")
    why = re.search(r"the new version failed (\d+) of (\d+) requests", fleet.log())
    assert why and int(why.group(1)) == int(why.group(2)) >= CanaryConfig().min_requests, fleet.log()[-2000:]
    assert metric(fleet.url, rolled_back) == before + 1
    wait_for(fleet, lambda: sorted(pool(fleet)["replicas"].values()) == ["ready", "ready"], 240)
    assert {r["version"] for r in replicas(fleet).values()} == {version}
    until = time.monotonic() + 2
    results = asyncio.run(load_until(fleet.url, lambda: time.monotonic() > until, clients=2))
    assert results and all(r["ok"] for r in results)


def test_the_canary_rule_needs_enough_requests_and_a_rate_far_above_the_old():
    cfg = CanaryConfig(min_requests=20, max_error_rate=0.2, error_rate_ratio=2.0)
    assert judge(Tally(19, 19), Tally(100, 0), cfg) is None  # too few to judge
    assert "20 of 20" in judge(Tally(20, 20), Tally(100, 0), cfg)
    assert judge(Tally(50, 5), Tally(100, 0), cfg) is None  # 10 %: under the bar
    assert judge(Tally(50, 20), Tally(100, 30), cfg) is None  # the old sheds load as much
    assert judge(Tally(50, 35), Tally(100, 30), cfg) is not None  # 70 % against 30 %


def test_the_latency_rule_compares_p99s_over_enough_samples_with_a_floor():
    cfg = CanaryConfig(min_ttft_samples=30, min_itl_samples=100)  # ratios 1.5, floor 50 ms
    fast, slow = (0.02,) * 100, (0.2,) * 100
    assert judge(Tally(itl=slow[:99]), Tally(itl=fast), cfg) is None  # too few samples to judge
    why = judge(Tally(itl=slow), Tally(itl=fast), cfg)
    assert "p99 time between tokens is 0.200 s against 0.020 s" in why
    assert "p99 time to first token" in judge(Tally(ttft=(0.9,) * 30), Tally(ttft=(0.3,) * 60), cfg)
    assert judge(Tally(ttft=(0.9,) * 29), Tally(ttft=(0.3,) * 60), cfg) is None
    assert judge(Tally(itl=(0.04,) * 100), Tally(itl=fast), cfg) is None  # 2x, but 20 ms: noise
    assert judge(Tally(itl=(0.11,) * 100), Tally(itl=(0.1,) * 100), cfg) is None  # 1.1x: within bounds
    # The p99, not the mean: one slow gap in a hundred is the tail the rule watches.
    assert judge(Tally(itl=(0.02,) * 98 + (0.5,) * 2), Tally(itl=fast), cfg) is not None


def test_a_canary_several_times_slower_is_rolled_back_with_the_figures_that_decided(fleet):
    # A real version that loads, answers and fails nothing, but runs the weights unquantized
    # (its p99 gap 2.1-3.4x the int4's here) one request at a time: the canary's share of three
    # clients queues for its one place, so its first tokens wait for whole answers (5.5 s at p99
    # against 0.13 s). It finishes 13 requests in 30 s, so the canary is watched long enough for
    # the judge's 30 first tokens.
    version = pool(fleet)["version"]
    slow = REPLICA_ARGS + " --quantization none --max-num-seqs 1"
    canary = ("--canary", "0.5", "--canary-seconds", "120")
    out = shoal("fleet", "update", "--gateway", fleet.url, "--replica-args", slow, *canary)
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 240

    def back() -> bool:
        p = pool(fleet)
        return (not p["updating"] and p["last_update"] == "rolled_back") or time.monotonic() > deadline

    results = asyncio.run(load_until(fleet.url, back, clients=3))
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]][:3]
    p = pool(fleet)
    assert p["last_update"] == "rolled_back" and p["version"] == version, p
    judged = p["judgement"]
    assert judged["decision"] == "rolled_back" and "p99 time" in judged["verdict"], judged
    new, old = judged["new"], judged["old"]
    enough = CanaryConfig()
    itl = min(new["itl_samples"], old["itl_samples"]) >= enough.min_itl_samples
    ttft = min(new["ttft_samples"], old["ttft_samples"]) >= enough.min_ttft_samples
    assert (itl and new["itl_p99_s"] > 2 * old["itl_p99_s"]) or (
        ttft and new["ttft_p99_s"] > 2 * old["ttft_p99_s"]
    ), judged
    assert "rolling back to version" in fleet.log() and '"decision": "rolled_back"' in fleet.log()
    gauge = 'shoal:gateway_rollout_itl_p99_seconds{pool="default",version="%s"}'
    assert metric(fleet.url, gauge % "new") > metric(fleet.url, gauge % "old") > 0
    wait_for(fleet, lambda: sorted(pool(fleet)["replicas"].values()) == ["ready", "ready"], 240)
    assert {r["version"] for r in replicas(fleet).values()} == {version}


def test_shadow_copies_judge_the_new_version_before_it_takes_traffic_and_a_good_one_is_promoted(fleet):
    """With --shadow the new version's first replica, once loaded, takes copies of requests only:
    each answered as the client's was (greedy), counted and thrown away. Being as good as the
    old, it is then promoted, with its figures."""
    version = pool(fleet)["version"]
    same = 'shoal:gateway_shadow_requests_total{outcome="same",pool="default"}'
    before = metric(fleet.url, same)
    flags = REPLICA_ARGS + " --max-num-seqs 64"
    update = ("fleet", "update", "--gateway", fleet.url, "--replica-args", flags)
    out = shoal(*update, "--shadow", "1.0", "--canary-seconds", "6")
    assert out.returncode == 0, out.stderr

    async def greedy(c: httpx.AsyncClient, i: int) -> dict:
        body = {"model": MODEL, "prompt": f"Fact {i}: the sea", "max_tokens": 12, "temperature": 0}
        r = await c.post(fleet.url + "/v1/completions", json=body)
        return {"ok": r.status_code == 200}

    async def load() -> list[dict]:
        out: list[dict] = []
        async with httpx.AsyncClient(timeout=120) as c:
            while pool(fleet)["updating"]:
                out += await asyncio.gather(*(greedy(c, len(out) + k) for k in range(2)))
        return out

    results = asyncio.run(load())
    assert results and all(r["ok"] for r in results)
    p = pool(fleet)
    assert p["last_update"] == "done" and p["version"] == version + 1, p
    assert p["judgement"]["decision"] == "promoted" and p["judgement"]["verdict"] is None
    assert metric(fleet.url, same) > before
    assert metric(fleet.url, 'shoal:gateway_shadow_requests_total{outcome="different",pool="default"}') == 0
    # Two clients at a time over two old replicas: the new one takes a copy while it has none in
    # flight and holds back the second, so it never carries more than an old one does.
    assert metric(fleet.url, 'shoal:gateway_shadow_requests_total{outcome="held",pool="default"}') > 0
    assert "takes shadow copies for 6 s" in fleet.log()
