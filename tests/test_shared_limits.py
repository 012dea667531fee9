"""Two gateways over one replica and one real redis-server on 127.0.0.1 (Debian's package): a
tenant's rate limit holds across both (not once per gateway), and when the store goes away the
gateways go on admitting on their own limits."""

from __future__ import annotations

import contextlib
import shutil
import time

import httpx
import pytest

from shoal.fleet.admission.tenants import key_digest
from tests.fleet_helpers import auth, start_gateway, start_redis, stop_redis, wait_until

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"tiny": "sk-tiny", "roomy": "sk-roomy", "pair": "sk-pair"}

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


@pytest.fixture(scope="module")
def redis_url():
    proc, url = start_redis()
    yield proc, url
    stop_redis(proc)


@pytest.fixture(scope="module")
def gateways(chat_server, redis_url, tmp_path_factory):
    """Two gateways over the same replica and the same store; tenant tiny may send 6 requests a
    minute (a bucket of a minute's worth), roomy 600, pair 600 with 2 in flight at most."""
    path = tmp_path_factory.mktemp("shared-limits") / "gw.toml"
    path.write_text(
        "".join(
            f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{key_digest(key)}"\n'
            f"requests_per_minute = {6 if name == 'tiny' else 600}\nburst_s = 60\n"
            + ("max_concurrency = 2\n" if name == "pair" else "")
            for name, key in KEYS.items()
        )
    )
    args = ("--config", str(path), "--store", redis_url[1])
    pair = [start_gateway([chat_server.url], *args, api_key="sk-operator") for _ in range(2)]
    yield pair, args
    for gw in pair:
        gw.stop()


def ask(gw, tenant: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    return httpx.post(gw.url + "/v1/completions", json=body, headers=auth(KEYS[tenant]), timeout=60)


def test_a_tenants_limit_holds_across_gateways_that_share_a_store(gateways):
    gateways, _ = gateways
    answers = [(i % 2, ask(gateways[i % 2], "tiny")) for i in range(12)]
    admitted = [g for g, r in answers if r.status_code == 200]
    # 6 a minute across both (one more may have refilled meanwhile: 0.1 a second), not 6 at each.
    assert 6 <= len(admitted) <= 7, [(g, r.status_code) for g, r in answers]
    assert set(admitted) == {0, 1}  # both gateways drew from the one bucket
    refused = [r for _, r in answers if r.status_code == 429]
    for r in refused:
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-remaining-requests"] == "0"  # what is left across both
    # Either gateway bills both gateways' requests (each writes what it counted to the store).
    # The other gateway's counts arrive with its next write, within a couple of seconds.
    for gw in gateways:
        deadline = time.monotonic() + 10
        while True:
            usage = httpx.get(gw.url + "/fleet/usage", headers=auth("sk-operator"), timeout=10).json()
            tiny = usage["tenants"].get("tiny", {}).get("interactive", {})
            seen = (tiny.get("requests"), tiny.get("rate_limited"))
            if seen == (len(admitted), len(refused)) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert seen == (len(admitted), len(refused)), usage


@contextlib.contextmanager
def stream_of(gw, tenant: str):
    """A long stream of `tenant`'s, held open until the exit: yields its answer, its first event
    read when admitted."""
    body = {"model": MODEL, "prompt": "Tell a story.", "max_tokens": 1000, "ignore_eos": True}
    url, headers = gw.url + "/v1/completions", auth(KEYS[tenant])
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", url, json={**body, "stream": True}, headers=headers) as r,
    ):
        if r.status_code != 200:
            r.read()
            yield r
            return
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        yield r


@contextlib.contextmanager
def held_stream(gw, tenant: str):
    with stream_of(gw, tenant) as r:
        assert r.status_code == 200, r.text
        yield


def both_places_free(one, two) -> bool:
    """Whether pair's two places are both free: one stream held on each gateway, a third refused."""
    with stream_of(one, "pair") as first, stream_of(two, "pair") as second:
        return first.status_code == second.status_code == 200 and ask(one, "pair").status_code == 429


def test_a_tenants_concurrency_limit_holds_across_gateways_and_outlives_no_gateway(gateways, chat_server):
    (one, two), args = gateways
    with held_stream(one, "pair"), held_stream(two, "pair"):
        for gw in (one, two):  # two in flight across both gateways: the limit
            r = ask(gw, "pair")
            assert r.status_code == 429 and "in flight across its gateways" in r.json()["error"]["message"]
    # Both places come back as the streams end.
    wait_until(one, lambda: both_places_free(one, two), 10)
    # A gateway that dies holding a place: its place comes back once it is known dead (5 s).
    third = start_gateway([chat_server.url], *args, api_key="sk-operator")
    try:
        with held_stream(one, "pair"):
            with held_stream(third, "pair"):
                assert ask(one, "pair").status_code == 429
                third.proc.kill()
                third.proc.wait(10)
                killed = time.monotonic()
            wait_until(one, lambda: ask(one, "pair").status_code == 200, 15, every=0.5)
            assert time.monotonic() - killed < 12
    finally:
        third.stop()


def test_without_its_store_a_gateway_admits_on_its_own_limits(gateways, redis_url):
    gateways, _ = gateways
    proc, _ = redis_url
    proc.terminate()
    proc.wait(10)
    for gw in gateways:
        r = ask(gw, "roomy")
        assert r.status_code == 200, r.text
        assert "admitting on this gateway's own" in gw.log()  # said once, by its limits or its beat
