"""Three real replicas behind real gateways on 127.0.0.1: routing policies, passthrough,
backpressure, passive ejection, and kill -9 mid-stream with no failed or altered answer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
from collections import Counter

import httpx
import openai
import pytest
from fastapi.responses import JSONResponse

from tests.cross_host_helpers import wait_idle
from tests.fleet_helpers import FLEET_KEY as KEY
from tests.fleet_helpers import auth, metric, replicas, start_gateway, wait_replicas_ready, wait_until
from tests.server_helpers import StandIn, raw_post, stand_in_app

LONG_PREFIX = " ".join(f"Fact {i}: the river bends near stone {i * 7}." for i in range(14))

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fleet(shared_fleet):
    """Three replicas behind a key (see conftest), shared with test_fleet_crash and
    test_fleet_hardening."""
    return shared_fleet


@pytest.fixture(scope="module")
def urls(fleet):
    return {name: r["url"] for name, r in replicas(fleet, KEY).items()}


@pytest.fixture(scope="module")
def gateways(urls):
    """One gateway per non-default policy over the fleet's replicas (names backend-0.. in url order)."""
    made = {
        p: start_gateway(list(urls.values()), "--policy", p, api_key=KEY) for p in ("round_robin", "session")
    }
    yield made
    for g in made.values():
        g.stop()


def post(gw, body, path="/v1/completions", headers=None, **kw):
    headers = {**auth(KEY), **(headers or {})}
    r = httpx.post(gw.url + path, json={"model": MODEL, **body}, timeout=120, headers=headers, **kw)
    assert r.status_code == 200, r.text
    return r


def test_openai_api_passes_through(fleet, urls):
    retries = metric(fleet.url, "shoal:gateway_retries_total")
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    msgs = [{"role": "user", "content": "Name a colour."}]
    via = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=8, temperature=0
    )
    direct = httpx.post(
        next(iter(urls.values())) + "/v1/chat/completions",
        json={"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0},
        headers=auth(KEY),
        timeout=60,
    ).json()
    assert via.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert via.usage.completion_tokens == direct["usage"]["completion_tokens"]
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert text == via.choices[0].message.content
    with pytest.raises(openai.BadRequestError):  # a client error passes through, untouched and not retried
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", max_tokens=-1)
    reps = fleet.get("/replicas", headers=auth(KEY)).json()["replicas"]
    assert len(reps) == 3 and all(r["pid"] and r["state"] == "ready" for r in reps)
    assert metric(fleet.url, "shoal:gateway_retries_total") == retries


def test_embeddings_pass_through_the_gateway(fleet, urls):
    body = {"model": MODEL, "input": ["Name a colour.", "Rivers run to the sea."]}
    via = post(fleet, body, path="/v1/embeddings").json()
    first = next(iter(urls.values()))
    direct = httpx.post(first + "/v1/embeddings", json=body, headers=auth(KEY), timeout=60)
    assert [d["index"] for d in via["data"]] == [0, 1] and via["usage"] == direct.json()["usage"]
    for a, b in zip(via["data"], direct.json()["data"]):
        assert max(abs(x - y) for x, y in zip(a["embedding"], b["embedding"])) < 1e-5


def test_round_robin_spreads_and_session_sticks(gateways):
    rr = gateways["round_robin"]
    seen = Counter(post(rr, {"prompt": f"q{i}", "max_tokens": 1}).headers["x-replica"] for i in range(6))
    assert sorted(seen.values()) == [2, 2, 2]
    sess = gateways["session"]
    for who in ("alice", "bob", "carol"):
        placed = {
            post(sess, {"prompt": f"{who} {i}", "max_tokens": 1}, headers={"x-session-id": who}).headers[
                "x-replica"
            ]
            for i in range(4)
        }
        assert len(placed) == 1
    by_user = {
        post(sess, {"prompt": f"u {i}", "max_tokens": 1, "user": "dave"}).headers["x-replica"]
        for i in range(3)
    }
    assert len(by_user) == 1


def test_kv_aware_sends_shared_prefixes_where_they_are_cached(fleet, urls):
    prefix_hits = 'shoal:gateway_routing_decisions_total{policy="kv_aware",reason="prefix_hit"}'
    routed_before = metric(fleet.url, prefix_hits)
    indexed_before = sum(r["cached_blocks"] for r in replicas(fleet, KEY).values())
    homes = {}
    for k in range(3):
        prefix = f"Document {k}. {LONG_PREFIX}"
        homes[k] = post(fleet, {"prompt": prefix + " Question one?", "max_tokens": 1}).headers["x-replica"]
    # The gateway polls KV events every 100 ms; on a loaded machine a poll can lag, so wait until
    # its index holds the three prompts' blocks (each over 10, beyond what earlier tests cached)
    # instead of for a fixed time.
    deadline = time.monotonic() + 15
    while (
        sum(r["cached_blocks"] for r in replicas(fleet, KEY).values()) < indexed_before + 30
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    for k in range(3):
        home = urls[homes[k]]
        hits = metric(home, "shoal:prefix_cache_hits_total")
        # The gateway's view of load comes from a poll; one taken while the previous request ran
        # would charge the home replica a request it no longer has (load_weight 8 against ~10
        # cached blocks is close). Ask once the gateway sees every replica idle.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(
            r["inflight"] or r["load"].get("running") or r["load"].get("waiting")
            for r in replicas(fleet, KEY).values()
        ):
            time.sleep(0.1)
        got = post(fleet, {"prompt": f"Document {k}. {LONG_PREFIX} Another question?", "max_tokens": 1})
        # On a failure, the view it decided on.
        assert got.headers["x-replica"] == homes[k], (k, homes, replicas(fleet, KEY))
        assert metric(home, "shoal:prefix_cache_hits_total") - hits >= 160  # the shared prefix was reused
    assert metric(fleet.url, prefix_hits) >= routed_before + 3


def test_kv_aware_falls_back_to_least_load_when_load_is_uneven(urls, tmp_path):
    cfg = tmp_path / "gw.toml"
    cfg.write_text('[gateway]\npolicy = "kv_aware"\nimbalance_limit = 2\n')
    gw = start_gateway(list(urls.values()), "--config", str(cfg), api_key=KEY)
    try:
        prompt = f"Busy doc. {LONG_PREFIX}"
        home = post(gw, {"prompt": prompt + " first", "max_tokens": 1}).headers["x-replica"]
        home_url = dict(zip([f"backend-{i}" for i in range(3)], urls.values()))[home]

        async def load_home_and_ask():
            async with httpx.AsyncClient(timeout=120, headers=auth(KEY)) as c:
                busy = [
                    asyncio.create_task(
                        c.post(
                            home_url + "/v1/completions",
                            json={
                                "model": MODEL,
                                "prompt": f"filler {i}",
                                "max_tokens": 64,
                                "ignore_eos": True,
                            },
                        )
                    )
                    for i in range(6)
                ]
                while replicas(gw, KEY)[home]["load"].get("running", 0) < 5:
                    await asyncio.sleep(0.05)
                r = await c.post(
                    gw.url + "/v1/completions",
                    json={"model": MODEL, "prompt": prompt + " second", "max_tokens": 1},
                )
                await asyncio.gather(*busy)
                return r

        r = asyncio.run(load_home_and_ask())
        assert r.status_code == 200 and r.headers["x-replica"] != home
        assert (
            metric(
                gw.url, 'shoal:gateway_routing_decisions_total{policy="kv_aware",reason="imbalance_fallback"}'
            )
            >= 1
        )
    finally:
        gw.stop()


def test_gateway_backpressure_gives_503_with_retry_after(urls, tmp_path):
    cfg = tmp_path / "gw.toml"
    cfg.write_text('[gateway]\npolicy = "least_load"\nmax_inflight_per_replica = 1\nmax_queue = 1\n')
    gw = start_gateway(list(urls.values())[:1], "--config", str(cfg), api_key=KEY)
    try:

        async def burst():
            async with httpx.AsyncClient(timeout=120, headers=auth(KEY)) as c:
                body = {"model": MODEL, "prompt": "Count:", "max_tokens": 24, "ignore_eos": True}
                return await asyncio.gather(
                    *(c.post(gw.url + "/v1/completions", json=body) for _ in range(6))
                )

        codes = [r.status_code for r in asyncio.run(burst())]
        assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
        assert metric(gw.url, "shoal:gateway_rejections_total") == codes.count(503)
    finally:
        gw.stop()


def test_a_client_that_leaves_while_queued_at_the_gateway_gives_its_place_back(urls, tmp_path):
    cfg = tmp_path / "gw.toml"
    cfg.write_text("[gateway]\nmax_inflight_per_replica = 1\nmax_queue = 1\n")
    gw = start_gateway(list(urls.values())[:1], "--config", str(cfg), api_key=KEY)
    long = {"model": MODEL, "prompt": "A long tale:", "max_tokens": 2000, "ignore_eos": True}
    queued = "shoal:gateway_queued_requests"
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        with raw_post(gw.url, "/v1/completions", long, auth(KEY)):  # the replica's one place
            wait_until(gw, lambda: metric(gw.url, "shoal:gateway_inflight_requests") == 1, 30)
            with raw_post(gw.url, "/v1/completions", {**long, "stream": True}, auth(KEY)):
                wait_until(gw, lambda: metric(gw.url, queued) == 1, 30, every=0.05)
            wait_until(gw, lambda: metric(gw.url, queued) == 0, 5, every=0.05)
            # The queue's one place is free again: a third client waits in it (not a 503)...
            third = pool.submit(post, gw, {"prompt": "Hi", "max_tokens": 4})
            wait_until(gw, lambda: metric(gw.url, queued) == 1, 30, every=0.05)
            assert not third.done()
        # ...and is served once the first client leaves too.
        assert third.result(timeout=60).json()["usage"]["completion_tokens"] == 4
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        gw.stop()


def test_a_replica_answering_500_is_ejected_by_passive_checks(urls):
    bad = stand_in_app()

    @bad.post("/v1/completions")
    async def broken():
        return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)

    with StandIn(bad) as bad_server:
        good = next(iter(urls.values()))
        gw = start_gateway([bad_server.url, good], "--policy", "round_robin", api_key=KEY)
        try:
            # Every request is answered: failures on the bad one are retried on the good one.
            for i in range(8):
                post(gw, {"prompt": f"p{i}", "max_tokens": 1})
            reps = replicas(gw, KEY)
            assert reps["backend-0"]["state"] in ("ejected", "half_open")
            assert (
                reps["backend-0"]["recent_errors"]
                and "HTTP 500" in reps["backend-0"]["recent_errors"][-1]["error"]
            )
            sent_to_bad = reps["backend-0"]["requests_total"]
            assert sent_to_bad == 3  # ejected after three consecutive failures, then left alone
            assert metric(gw.url, "shoal:gateway_ejections_total") >= 1
        finally:
            gw.stop()


@pytest.fixture(scope="module")
def unfolded(urls, tmp_path_factory):
    """A gateway that sends non-streamed requests on as they are, not as streams (fold.py)."""
    config = tmp_path_factory.mktemp("unfolded") / "fleet.toml"
    config.write_text("[gateway]\nfold_unary = false\n")
    gw = start_gateway(list(urls.values()), "--config", str(config), api_key=KEY)
    yield gw
    gw.stop()


@pytest.mark.parametrize(
    "fold, path, body",
    [
        (True, "/v1/chat/completions", {"messages": [{"role": "user", "content": "A long tale, please."}]}),
        (False, "/v1/completions", {"prompt": "A long tale:"}),
    ],
    ids=["folded-chat", "unfolded-completions"],
)
def test_a_client_that_leaves_a_non_streamed_request_stops_it_on_its_replica(
    fleet, unfolded, urls, path, body, fold
):
    gw = fleet if fold else unfolded
    body = {"model": MODEL, **body, "max_tokens": 2000, "ignore_eos": True}
    left = 'shoal:gateway_responses_total{status="499"'
    left_before = metric(gw.url, left)
    with httpx.Client(headers=auth(KEY), timeout=10) as c:

        def load(url: str) -> dict:
            return c.get(url + "/load").json()

        with raw_post(gw.url, path, body, auth(KEY)):
            running = wait_until(gw, lambda: [u for u in urls.values() if load(u)["running"]], 30, 0.02)
        steps_at_close = load(running[0])["num_steps"]
    now = wait_idle(running[0], 10, auth(KEY))
    # The gateway closes its request to the replica, which aborts it as it would its own client's.
    assert now["num_steps"] - steps_at_close <= 3
    assert metric(gw.url, left) == left_before + 1


def test_kill_9_mid_stream_loses_nothing(fleet, gateways):
    prompts = [f"Tell me about planet number {i}." for i in range(6)]
    body = {"model": MODEL, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # greedy: batching changes no token
        answers = pool.map(lambda p: post(fleet, {**body, "prompt": p}), prompts)
        expected = {p: a.json()["choices"][0]["text"] for p, a in zip(prompts, answers, strict=True)}
    before = replicas(fleet, KEY)
    failovers = metric(fleet.url, "shoal:gateway_failovers_total")

    async def stream(c, p, results):
        text, finishes, usage, replica = "", [], None, None
        async with c.stream(
            "POST",
            fleet.url + "/v1/completions",
            json={**body, "prompt": p, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            assert r.status_code == 200
            replica = r.headers["x-replica"]
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                usage = obj.get("usage") or usage
                for ch in obj["choices"]:
                    text += ch["text"]
                    if ch["finish_reason"]:
                        finishes.append(ch["finish_reason"])
                results[p] = (replica, len(text))
        return text, finishes, usage

    async def run():
        results: dict = {}
        async with httpx.AsyncClient(timeout=180, headers=auth(KEY)) as c:
            tasks = [asyncio.create_task(stream(c, p, results)) for p in prompts]
            while len(results) < len(prompts) or min(n for _, n in results.values()) < 20:
                await asyncio.sleep(0.02)
            victim = Counter(rep for rep, _ in results.values()).most_common(1)[0][0]
            os.kill(before[victim]["pid"], signal.SIGKILL)
            return victim, await asyncio.gather(*tasks)

    victim, outs = asyncio.run(run())
    for p, (text, finishes, usage) in zip(prompts, outs):
        assert text == expected[p], p  # greedy: identical to the uninterrupted answer
        assert finishes == ["length"]
        assert usage["completion_tokens"] == 60
    assert metric(fleet.url, "shoal:gateway_failovers_total") >= failovers + 1
    # The supervisor restarts the victim, which takes traffic again.
    reps = wait_replicas_ready(fleet, 3, api_key=KEY)
    restarted = {r["name"]: r for r in reps}[victim]
    assert restarted["pid"] != before[victim]["pid"]
    served = restarted["requests_total"]
    for i in range(9):
        post(fleet, {"prompt": f"after {i}", "max_tokens": 1})
    assert replicas(fleet, KEY)[victim]["requests_total"] > served
