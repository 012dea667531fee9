"""LoRA adapters across a fleet: two real replicas of the bundled model (one started with adapter
`alpha`, one with none) behind a real gateway with tenants. An adapter's requests go to the replica
that holds it; when that one is busy the gateway loads the adapter on the other and sends it
requests too; the gateway's prompt hashes for an adapter are the replica's own (its KV events);
vLLM's load and unload routes work fleet-wide; `/v1/models` lists the adapters with their parent;
an unknown adapter is a 404; a tenant limited to one adapter gets that one and nothing else."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from shoal.fleet.admission.tenants import key_digest
from shoal.protocol.block_hash import hash_blocks, root_hash
from shoal.protocol.secrets import kv_salt
from tests.fleet_helpers import auth, metric, spawn, wait_replicas_ready, wait_until
from tests.server_helpers import start_servers
from tests.test_lora_server import make_adapter

peft = pytest.importorskip("peft")

KEY = "sk-lora-fleet"  # the gateway's own key, which the replicas require too
TENANTS = {"everyone": "sk-everyone", "alpha-only": "sk-alpha-only"}
BASE = "SmolLM2-135M-Instruct"
PROMPT = "Write a short note about the sea and the ships that cross it every day."
BUSY_AT = 2  # outstanding requests from which a holder counts as busy


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, hf_bundled):
    root = tmp_path_factory.mktemp("fleet-adapters")
    make_adapter(hf_bundled, root / "alpha", 11, ["q_proj", "v_proj", "up_proj"], 8)
    make_adapter(hf_bundled, root / "beta", 12, ["k_proj", "o_proj", "down_proj"], 8)
    return root


@pytest.fixture(scope="module")
def fleet(adapter_dirs, tmp_path_factory):
    common = ("--enable-lora", "--max-loras", "2", "--api-key", KEY, "--kv-cache-memory", "128MiB")
    with_alpha = [*common, "--threads", "1", "--lora-modules", f"alpha={adapter_dirs / 'alpha'}"]
    holder, other = start_servers(with_alpha, [*common, "--threads", "1"])
    config = tmp_path_factory.mktemp("lora-gw") / "gateway.toml"
    tenants = "".join(
        f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{key_digest(key)}"\n'
        + ('models = ["alpha"]\n' if name == "alpha-only" else "")
        for name, key in TENANTS.items()
    )
    config.write_text(f'[gateway]\napi_key = "{KEY}"\nadapter_busy_at = {BUSY_AT}\n{tenants}')
    gw = spawn(["gateway", "--config", str(config), "--backend", holder.url, "--backend", other.url])
    try:
        wait_replicas_ready(gw, 2, api_key=KEY)
        # Routing by adapter needs each replica's report of what it holds.
        wait_until(gw, lambda: all("lora" in r["load"] for r in replicas(gw)), 30)
        yield gw, holder, other
    finally:
        gw.stop()
        holder.stop()
        other.stop()


def replicas(gw) -> list[dict]:
    return gw.get("/replicas", headers=auth(KEY)).json()["replicas"]


def complete(url: str, key: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, headers=auth(key), timeout=120)


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def adapter_requests(server, adapter: str) -> float:
    return metric(server.url, f'shoal:lora_requests_total{{adapter="{adapter}"')


def listed(url: str, key: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(url + "/v1/models", headers=auth(key), timeout=10).json()["data"]}


def test_an_adapters_requests_go_where_it_is_and_spread_when_that_replica_is_busy(fleet):
    gw, holder, other = fleet
    everyone = TENANTS["everyone"]
    want = tokens(complete(holder.url, KEY, "alpha"))
    assert want != tokens(complete(holder.url, KEY, BASE))  # the adapter changes the answer
    models = listed(gw.url, everyone)
    assert models["alpha"]["parent"] == BASE and models[BASE]["parent"] is None
    before = adapter_requests(holder, "alpha")
    for _ in range(4):  # one at a time: the holder is never busy
        assert tokens(complete(gw.url, everyone, "alpha")) == want
    assert adapter_requests(holder, "alpha") == before + 4
    assert adapter_requests(other, "alpha") == 0
    unknown = complete(gw.url, everyone, "no-such-adapter")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

    async def streams(n: int) -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
            body |= {"ignore_eos": True, "return_token_ids": True}
            answers = await asyncio.gather(
                *(c.post(gw.url + "/v1/completions", json=body, headers=auth(everyone)) for _ in range(n))
            )
        return [tokens(a) for a in answers]

    # Many at once: the holder is busy, so the gateway loads alpha on the other replica.
    assert asyncio.run(streams(8)) == [want] * 8
    wait_until(
        gw,
        lambda: "alpha" in httpx.get(other.url + "/load", headers=auth(KEY)).json()["lora"]["adapters"],
        30,
    )
    assert metric(gw.url, 'shoal:gateway_adapter_loads_total{adapter="alpha",reason="busy"') == 1
    assert asyncio.run(streams(8)) == [want] * 8
    assert adapter_requests(other, "alpha") > 0  # and it takes some of them, with the same tokens
    assert metric(gw.url, 'shoal:gateway_replica_adapters{replica="backend-1",state="registered"') >= 1


def test_the_gateways_prompt_hashes_for_an_adapter_are_the_replicas_own(fleet):
    gw, holder, _ = fleet
    after = httpx.get(holder.url + "/kv_events", headers=auth(KEY)).json()["next"]
    prompt = " ".join(["tide"] * 80)
    assert complete(gw.url, TENANTS["everyone"], "alpha", prompt=prompt, max_tokens=1).status_code == 200
    events = httpx.get(holder.url + "/kv_events", params={"after": after}, headers=auth(KEY)).json()
    stored = {e["block_hash"] for e in events["events"] if e["kind"] == "stored"}
    ids = httpx.post(holder.url + "/tokenize", json={"prompt": prompt}, headers=auth(KEY)).json()["tokens"]
    root = root_hash(kv_salt(None, KEY))
    as_gateway = hash_blocks(ids, events["block_size"], (("lora", "alpha"),), root=root)
    assert len(as_gateway) >= 4 and set(as_gateway) <= stored
    assert not set(hash_blocks(ids, events["block_size"], root=root)) & stored  # not the base's blocks


def test_adapters_load_and_unload_fleet_wide_and_tenants_see_only_theirs(fleet, adapter_dirs):
    gw, holder, other = fleet
    load = {"lora_name": "beta", "lora_path": str(adapter_dirs / "beta")}
    assert (
        httpx.post(gw.url + "/v1/load_lora_adapter", json=load, headers=auth(TENANTS["everyone"])).status_code
        == 401
    )
    bad = httpx.post(
        gw.url + "/v1/load_lora_adapter", json={**load, "lora_path": "/nowhere"}, headers=auth(KEY)
    )
    assert bad.status_code == 400
    assert "beta" not in listed(gw.url, TENANTS["everyone"])
    loaded = httpx.post(gw.url + "/v1/load_lora_adapter", json=load, headers=auth(KEY), timeout=60)
    assert loaded.status_code == 200, loaded.text
    [where] = loaded.json()["replicas"]
    assert listed(gw.url, TENANTS["everyone"])["beta"]["parent"] == BASE
    direct = holder if where == "backend-0" else other
    got = tokens(complete(gw.url, TENANTS["everyone"], "beta"))
    assert got == tokens(complete(direct.url, KEY, "beta"))
    assert got != tokens(complete(direct.url, KEY, BASE))

    fenced = TENANTS["alpha-only"]
    assert set(listed(gw.url, fenced)) == {"alpha"}
    assert complete(gw.url, fenced, "alpha").status_code == 200
    for model in (BASE, "beta"):
        refused = complete(gw.url, fenced, model)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"

    unloaded = httpx.post(gw.url + "/v1/unload_lora_adapter", json={"lora_name": "alpha"}, headers=auth(KEY))
    assert unloaded.status_code == 200, unloaded.text
    assert sorted(unloaded.json()["replicas"]) == ["backend-0", "backend-1"]
    assert "alpha" not in listed(gw.url, TENANTS["everyone"])
    for server in (holder, other):
        assert "alpha" not in httpx.get(server.url + "/load", headers=auth(KEY)).json()["lora"]["adapters"]
    assert complete(gw.url, TENANTS["everyone"], "alpha").status_code == 404
    assert (
        httpx.post(
            gw.url + "/v1/unload_lora_adapter", json={"lora_name": "alpha"}, headers=auth(KEY)
        ).status_code
        == 404
    )
    assert torch.tensor([r["inflight"] for r in replicas(gw)]).sum() == 0
