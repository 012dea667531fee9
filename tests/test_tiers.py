"""The tiers policy on a real fleet of two models, the bundled model in int4 (cheap) and in fp32
(strong): a hint, a long prompt or an unsure cheap answer goes to the strong model, a confident
one stays cheap, and every escalation is counted."""

from __future__ import annotations

import httpx
import pytest

from tests.fleet_helpers import metric, spawn, wait_until

ARGS = '["--threads", "1", "--kv-cache-memory", "128MiB"]'
FLEET = f"""
[[models]]
name = "small"
replica_args = {ARGS[:-1]}, "--quantization", "int4"]

[[models]]
name = "large"
replica_args = {ARGS[:-1]}, "--quantization", "none"]

[[tiers]]
name = "auto"
cheap = "small"
strong = "large"
max_prompt_tokens = 40
min_confidence = {{conf}}

[[tiers]]
name = "auto-sure"
cheap = "small"
strong = "large"
min_confidence = 0.001
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    where = tmp_path_factory.mktemp("tiers")
    (where / "fleet.toml").write_text(FLEET.replace("{conf}", "0.999"))
    gw = spawn(["fleet", "up", "--config", str(where / "fleet.toml"), "--base-port", "0"])
    try:
        wait_until(gw, lambda: all(ask(gw, m).status_code == 200 for m in ("small", "large")), 240, every=0.5)
        yield gw
    finally:
        gw.stop()


def ask(gw, model: str, prompt: str = "The capital of France is", headers=None, **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
    return httpx.post(gw.url + "/v1/completions", json=body, headers=headers or {}, timeout=120)


def test_tiers_escalate_by_hint_length_and_confidence(fleet):
    strong = ask(fleet, "large").json()["choices"][0]["text"]

    sure = ask(fleet, "auto-sure")  # any answer clears 0.001: the cheap model's stands
    assert sure.status_code == 200 and sure.headers["x-shoal-tier"] == "cheap"
    assert sure.headers["x-shoal-tier-reason"] == "confident"
    assert float(sure.headers["x-shoal-tier-confidence"]) > 0.001
    assert sure.json()["choices"][0]["logprobs"] is None  # asked for the rule, not by the client
    asked = ask(fleet, "auto-sure", logprobs=1).json()["choices"][0]["logprobs"]
    assert asked["token_logprobs"] and asked["top_logprobs"][0]  # the client's own request is kept

    unsure = ask(fleet, "auto")  # no 6-token answer is 99.9 % sure: escalated
    assert (
        unsure.headers["x-shoal-tier"] == "strong" and unsure.headers["x-shoal-tier-reason"] == "confidence"
    )
    assert unsure.json()["choices"][0]["text"] == strong

    long = ask(fleet, "auto", prompt="The capital of France is " * 12)
    assert long.headers["x-shoal-tier"] == "strong" and long.headers["x-shoal-tier-reason"] == "length"
    hinted = ask(fleet, "auto-sure", headers={"x-shoal-tier": "strong"})
    assert hinted.headers["x-shoal-tier-reason"] == "hint" and hinted.json()["choices"][0]["text"] == strong
    pinned = ask(fleet, "auto", tier="cheap")
    assert pinned.headers["x-shoal-tier"] == "cheap"
    bad = ask(fleet, "auto", tier="best")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tier"

    streamed = httpx.post(
        fleet.url + "/v1/completions",
        json={"model": "auto", "prompt": "Hello", "max_tokens": 3, "stream": True},
        timeout=60,
    )
    assert streamed.headers["x-shoal-tier"] == "cheap" and "[DONE]" in streamed.text  # no confidence rule

    assert metric(fleet.url, 'shoal:gateway_tier_escalations_total{reason="confidence",route="auto"}') == 1
    assert metric(fleet.url, 'shoal:gateway_tier_escalations_total{reason="length",route="auto"}') == 1
    assert metric(fleet.url, 'shoal:gateway_tier_escalations_total{reason="hint",route="auto-sure"}') == 1
    models = {m["id"] for m in httpx.get(fleet.url + "/v1/models", timeout=30).json()["data"]}
    assert {"small", "large", "auto", "auto-sure"} <= models
