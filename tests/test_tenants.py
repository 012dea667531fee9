"""The gateway's admission on a real fleet of two models, the bundled model in int4 ("small", the
cheap tier) and in fp32 ("large", the strong one). Tenants: keys map to tenants, limits answer
429 with OpenAI's headers, a tenant keeps to its models, a client cannot raise its priority, and
while the replica is full the queue serves a quiet tenant before a flooding one's backlog; usage
is counted per tenant. Tiers: a hint, a long prompt or an unsure cheap answer goes to the strong
model, a confident one stays cheap, and every escalation is counted."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import time

import httpx
import pytest

from shoal.fleet.admission.tenants import key_digest
from tests.fleet_helpers import auth, metric, spawn, wait_until

MODEL = "small"
OPERATOR = "sk-operator"
KEYS = {"alpha": "sk-alpha", "flood": "sk-flood", "tiny": "sk-tiny", "low": "sk-low", "fenced": "sk-fenced"}


def fleet_toml(state_dir) -> str:
    def tenant(name: str, extra: str = "") -> str:
        return f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{key_digest(KEYS[name])}"\n{extra}\n'

    args = '"--threads", "1", "--kv-cache-memory", "128MiB"'
    return (
        f'[[models]]\nname = "small"\nreplica_args = [{args}, "--quantization", "int4"]\n'
        f'[[models]]\nname = "large"\nreplica_args = [{args}, "--quantization", "none"]\n'
        # One request at a time on a replica: the rest wait in the gateway's queue, in its order.
        f'[gateway]\nmax_inflight_per_replica = 1\nstate_dir = "{state_dir}"\napi_key = "{OPERATOR}"\n'
        + tenant("alpha")
        + tenant("flood", "requests_per_minute = 600\nburst_s = 60")
        + tenant("tiny", "requests_per_minute = 2\nburst_s = 60")
        + tenant("low", "priority = 5")
        + tenant("fenced", 'models = ["some-other-model"]')
        + '[[tiers]]\nname = "auto"\ncheap = "small"\nstrong = "large"\nmax_prompt_tokens = 40\n'
        # No 6-token answer is 99.9 % sure: escalated; any clears 0.001.
        + "min_confidence = 0.999\n"
        + '[[tiers]]\nname = "auto-sure"\ncheap = "small"\nstrong = "large"\nmin_confidence = 0.001\n'
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    where = tmp_path_factory.mktemp("tenants")
    path = where / "fleet.toml"
    path.write_text(fleet_toml(where / "state"))
    gw = spawn(["fleet", "up", "--config", str(path), "--base-port", "0"])
    try:
        ready = ("small", "large")
        wait_until(
            gw, lambda: all(ask(gw, "alpha", model=m).status_code == 200 for m in ready), 240, every=0.5
        )
        yield gw
    finally:
        gw.stop()


def ask(gw, tenant: str | None, max_tokens: int = 4, headers=None, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0}
    body.update(extra)
    key = KEYS.get(tenant, tenant)
    return httpx.post(
        gw.url + "/v1/completions", json=body, headers={**auth(key), **(headers or {})}, timeout=120
    )


def test_keys_limits_and_models(fleet):
    ok = ask(fleet, "alpha")
    assert ok.status_code == 200 and ok.headers["x-shoal-priority"] == "0"
    for key in (None, "sk-unknown", OPERATOR + "x"):
        r = ask(fleet, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

    first = ask(fleet, "tiny")
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert ask(fleet, "tiny").status_code == 200
    refused = ask(fleet, "tiny")
    assert refused.status_code == 429, refused.text
    err = refused.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 30
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    assert ask(fleet, "alpha").status_code == 200  # one tenant's limit is not another's

    fenced = ask(fleet, "fenced")
    assert fenced.status_code == 404 and fenced.json()["error"]["code"] == "model_not_found"
    listed = httpx.get(fleet.url + "/v1/models", headers=auth(KEYS["fenced"]), timeout=30).json()
    assert listed["data"] == []  # it sees no model it may not use
    assert httpx.get(fleet.url + "/v1/models", headers=auth(KEYS["alpha"]), timeout=30).json()["data"]
    assert metric(fleet.url, "shoal:gateway_tenant_rate_limited_total") >= 1
    # Fleet state and usage are the operator's, not a tenant's.
    assert httpx.get(fleet.url + "/fleet/usage", headers=auth(KEYS["alpha"])).status_code == 401


def timed(gw, tenant: str, **extra) -> tuple[str, float, httpx.Response]:
    r = ask(gw, tenant, **extra)
    return tenant, time.monotonic(), r


def test_priority_is_the_gateways_to_give(fleet):
    """With the replica busy, `low` (class 5) asks for priority -10 and is queued first; alpha's
    request, queued after it at the default class, still runs first."""
    with cf.ThreadPoolExecutor(4) as pool:
        busy = pool.submit(timed, fleet, "alpha", max_tokens=200, ignore_eos=True)
        time.sleep(0.3)
        low = pool.submit(timed, fleet, "low", priority=-10)
        time.sleep(0.3)
        alpha = pool.submit(timed, fleet, "alpha")
        results = [f.result() for f in (busy, low, alpha)]
    for _, _, r in results:
        assert r.status_code == 200, r.text
    assert results[1][2].headers["x-shoal-priority"] == "5"  # its class, not what it asked
    assert results[2][1] < results[1][1], "the default class ran after a lower one"
    lowered = ask(fleet, "alpha", priority=3)
    assert lowered.headers["x-shoal-priority"] == "3"  # lowering oneself is allowed


def test_a_flooding_tenant_waits_behind_a_quiet_one(fleet):
    """The flood queues 8 requests; a quiet tenant's one request, sent after them, is served after
    at most two of them (the running one and one in turn), not after all eight."""
    with cf.ThreadPoolExecutor(10) as pool:
        floods = [pool.submit(timed, fleet, "flood", max_tokens=24, ignore_eos=True) for _ in range(8)]
        time.sleep(0.5)
        quiet = pool.submit(timed, fleet, "alpha", max_tokens=24, ignore_eos=True)
        done = [f.result() for f in [*floods, quiet]]
    assert all(r.status_code == 200 for _, _, r in done), [r.text for _, _, r in done if r.status_code != 200]
    quiet_at = done[-1][1]
    before = sum(t < quiet_at for _, t, _ in done[:-1])
    assert before <= 3, f"{before} flood requests finished before the quiet tenant's"
    queued = metric(fleet.url, 'shoal:gateway_tenant_queue_seconds_count{tenant="flood"}')
    assert queued >= 8

    def usage():
        return httpx.get(fleet.url + "/fleet/usage", headers=auth(OPERATOR), timeout=10).json()["tenants"]

    flood = usage()["flood"]["interactive"]
    assert flood["requests"] == 8 and flood["completion_tokens"] == 8 * 24 and flood["prompt_tokens"] > 8
    cli = [sys.executable, "-m", "shoal.cli", "fleet", "usage", "--gateway", fleet.url, "--api-key", OPERATOR]
    table = subprocess.run(cli, capture_output=True, text=True, timeout=60).stdout
    assert any(line.split()[:3] == ["flood", "interactive", "8"] for line in table.splitlines()), table


def test_tiers_escalate_by_hint_length_and_confidence(fleet):
    strong = ask(fleet, "alpha", 6, model="large").json()["choices"][0]["text"]

    sure = ask(fleet, "alpha", 6, model="auto-sure")  # the cheap model's answer stands
    assert sure.status_code == 200 and sure.headers["x-shoal-tier"] == "cheap"
    assert sure.headers["x-shoal-tier-reason"] == "confident"
    assert float(sure.headers["x-shoal-tier-confidence"]) > 0.001
    assert sure.json()["choices"][0]["logprobs"] is None  # asked for the rule, not by the client
    asked = ask(fleet, "alpha", 6, model="auto-sure", logprobs=1).json()["choices"][0]["logprobs"]
    assert asked["token_logprobs"] and asked["top_logprobs"][0]  # the client's own request is kept

    unsure = ask(fleet, "alpha", 6, model="auto")
    assert (
        unsure.headers["x-shoal-tier"] == "strong" and unsure.headers["x-shoal-tier-reason"] == "confidence"
    )
    assert unsure.json()["choices"][0]["text"] == strong

    long = ask(fleet, "alpha", 6, model="auto", prompt="The capital of France is " * 12)
    assert long.headers["x-shoal-tier"] == "strong" and long.headers["x-shoal-tier-reason"] == "length"
    hinted = ask(fleet, "alpha", 6, model="auto-sure", headers={"x-shoal-tier": "strong"})
    assert hinted.headers["x-shoal-tier-reason"] == "hint" and hinted.json()["choices"][0]["text"] == strong
    assert ask(fleet, "alpha", 6, model="auto", tier="cheap").headers["x-shoal-tier"] == "cheap"
    bad = ask(fleet, "alpha", 6, model="auto", tier="best")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tier"

    streamed = ask(fleet, "alpha", 3, model="auto", stream=True)
    assert streamed.headers["x-shoal-tier"] == "cheap" and "[DONE]" in streamed.text  # no confidence rule

    def escalations(route: str, reason: str) -> float:
        return metric(fleet.url, f'shoal:gateway_tier_escalations_total{{reason="{reason}",route="{route}"}}')

    assert escalations("auto", "confidence") == 1 and escalations("auto", "length") == 1
    assert escalations("auto-sure", "hint") == 1
    listed = httpx.get(fleet.url + "/v1/models", headers=auth(KEYS["alpha"]), timeout=30).json()["data"]
    assert {"small", "large", "auto", "auto-sure"} <= {m["id"] for m in listed}
