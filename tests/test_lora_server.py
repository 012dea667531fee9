"""`shoal serve --enable-lora` on the bundled model, with random adapters made by peft: a request
names an adapter as its model and gets HF's tokens under that adapter (fp32 weights); /v1/models
lists the adapters with their parent; vLLM's load and unload routes change the set at run time,
behind the API key, while other streams go on; an unknown adapter is a 404, one in use cannot be
unloaded, and a bad folder is a 400 that changes nothing."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import pytest
import torch

from tests.helpers import hf_greedy
from tests.server_helpers import start_server, stream_gaps

peft = pytest.importorskip("peft")

KEY = "lora-test-key"
H = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The best way to learn a new language is"
TOKENS = 12


def make_adapter(hf_model, path, seed: int, targets: list[str], rank: int, std: float = 0.08):
    """A random adapter saved as PEFT saves it; returns the model with it applied (a copy)."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, std)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_bundled, bundled):
    """Three adapters for the bundled model, and HF's greedy tokens for PROMPT under each."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "alpha": (1, ["q_proj", "v_proj", "down_proj"], 8),
        "beta": (2, ["k_proj", "o_proj", "gate_proj", "up_proj"], 16),
        "gamma": (3, ["q_proj", "up_proj"], 4),
    }
    ids = bundled.tokenizer.encode(PROMPT)
    refs = {None: hf_greedy(hf_bundled, ids, TOKENS)[0]}
    for name, (seed, targets, rank) in specs.items():
        refs[name] = hf_greedy(make_adapter(hf_bundled, root / name, seed, targets, rank), ids, TOKENS)[0]
    for name in specs:
        assert refs[name] != refs[None], name  # each one changes what the model says
    return root, refs


@pytest.fixture(scope="module")
def server(adapters):
    root, _ = adapters
    srv = start_server(
        "--quantization", "none", "--enable-lora", "--lora-modules", f"alpha={root / 'alpha'}",
        "--max-loras", "2", "--api-key", KEY, "--kv-cache-memory", "256MiB", "--threads", "2",
    )  # fmt: skip
    yield srv
    srv.stop()


def complete(server, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(server.url + "/v1/completions", json={**body, **extra}, headers=H, timeout=60)


def models(server) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(server.url + "/v1/models", headers=H).json()["data"]}


def token_ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_request_names_an_adapter_as_its_model_and_gets_hfs_tokens(server, adapters):
    _, refs = adapters
    listed = models(server)
    assert set(listed) == {"SmolLM2-135M-Instruct", "alpha"}
    assert listed["alpha"]["parent"] == "SmolLM2-135M-Instruct"
    assert listed["SmolLM2-135M-Instruct"]["parent"] is None
    r = complete(server, "alpha", return_token_ids=True)
    assert token_ids(r) == refs["alpha"]
    assert r.json()["model"] == "alpha"
    assert token_ids(complete(server, "SmolLM2-135M-Instruct", return_token_ids=True)) == refs[None]
    unknown = complete(server, "delta")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert "'alpha'" in unknown.json()["error"]["message"]  # it says what is served


def test_adapters_load_and_unload_at_run_time_while_streams_go_on(server, adapters):
    root, refs = adapters
    load = server.url + "/v1/load_lora_adapter"

    def adapter(name: str) -> dict:
        return {"lora_name": name, "lora_path": str(root / name)}

    unload = server.url + "/v1/unload_lora_adapter"
    # Behind the key, and checked before anything changes.
    assert httpx.post(load, json={"lora_name": "beta", "lora_path": str(root / "beta")}).status_code == 401
    bad = httpx.post(load, json={"lora_name": "beta", "lora_path": str(root / "nowhere")}, headers=H)
    assert bad.status_code == 400 and "not a folder" in bad.json()["error"]["message"]
    assert set(models(server)) == {"SmolLM2-135M-Instruct", "alpha"}

    async def run() -> tuple[list[float], dict]:
        gaps: list[float] = []
        body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 96, "ignore_eos": True, "stream": True}

        def stream(c: httpx.AsyncClient):
            return stream_gaps(c, server.url + "/v1/completions", body, gaps, headers=H)

        async with httpx.AsyncClient(timeout=60) as c:
            streams = [asyncio.create_task(stream(c)) for _ in range(3)]
            await asyncio.sleep(0.5)
            # alpha is in use: it cannot go now.
            busy = await c.post(unload, json={"lora_name": "alpha"}, headers=H)
            loaded = await c.post(load, json=adapter("beta"), headers=H)
            again = await c.post(load, json=adapter("gamma"), headers=H)
            await asyncio.gather(*streams)
        return gaps, {"busy": busy, "loaded": loaded, "again": again}

    gaps, answers = asyncio.run(run())
    assert answers["busy"].status_code == 409, answers["busy"].text
    assert answers["busy"].json()["error"]["code"] == "adapter_in_use"
    assert answers["loaded"].status_code == 200, answers["loaded"].text
    assert answers["again"].status_code == 200, answers["again"].text
    assert max(gaps) < 5.0, max(gaps)  # the loads never held the running streams up for long
    assert set(models(server)) == {"SmolLM2-135M-Instruct", "alpha", "beta", "gamma"}
    # Three adapters, two slots: each still gives its own tokens.
    for name in ("beta", "gamma", "alpha", "beta"):
        assert token_ids(complete(server, name, return_token_ids=True)) == refs[name], name
    # Unloaded once idle: it is gone, and asking for it is a 404.
    assert httpx.post(unload, json={"lora_name": "alpha"}, headers=H).status_code == 200
    assert complete(server, "alpha").status_code == 404
    assert httpx.post(unload, json={"lora_name": "alpha"}, headers=H).status_code == 404
    assert "alpha" not in models(server)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'shoal:lora_adapter_resident{adapter="beta",model_name="SmolLM2-135M-Instruct"} 1.0' in metrics
    assert 'adapter="alpha"' in metrics  # its requests are still counted
    assert "shoal:lora_adapter_evictions_total" in metrics
    load_info = httpx.get(server.url + "/load", headers=H).json()
    assert load_info["running"] == 0 and load_info["kv_usage"] == 0
    assert json.loads(json.dumps(load_info))  # plain JSON
