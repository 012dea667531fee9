"""Embeddings: a prompt's final hidden states pooled (mean or last token) and normalized, equal to
HF's for the bundled model, computed in chunks and in the same steps as generation, and alike
batched or alone; `POST /v1/embeddings` in OpenAI's shape (text, several texts, token ids, float
and base64, dimensions), its bad input refused without a trace, and through the gateway."""

from __future__ import annotations

import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from shoal.engine.pooling import PromptPooler
from shoal.engine.sampling_params import SamplingParams
from shoal.llm import LLM
from shoal.models.hf_loader import load_hf_config
from tests.server_helpers import start_server
from tests.test_hf_parity import make_random_checkpoint

TEXTS = [
    "The lighthouse stood on the rocks above the bay. " * 8,  # longer than two chunks
    "Rivers run to the sea.",
    "A short one",
]
MODEL = "SmolLM2-135M-Instruct"


def hf_embedding(hf, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].double()  # after the final norm
    return F.normalize(hidden.mean(0) if pooling == "mean" else hidden[-1], dim=0)


@pytest.fixture(scope="module")
def llm(bundled):
    # Chunks of 32 tokens: the long prompt's embedding is gathered over several steps.
    with LLM(loaded=bundled, max_num_batched_tokens=32, kv_cache_memory=64 << 20) as engine:
        yield engine


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_hf_pooled_hidden_states_batched_with_generation(llm, hf_bundled, pooling):
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    assert len(ids[0]) > 64
    embed = SamplingParams(max_tokens=0, pooling=pooling)
    generate = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone_gen = llm.generate("Once upon a time", generate)[0].outputs[0].token_ids
    outs = llm.generate([*ids, "Once upon a time"], [embed] * len(ids) + [generate])
    for i, out in enumerate(outs[:-1]):
        got = torch.tensor(out.embedding, dtype=torch.float64)
        want = hf_embedding(hf_bundled, ids[i], pooling)
        assert got.shape == want.shape and abs(got.norm().item() - 1) < 1e-9
        assert torch.allclose(got, want, atol=2e-4), (i, (got - want).abs().max())
        assert out.outputs[0].token_ids == []  # nothing generated
        alone = llm.generate([ids[i]], embed)[0].embedding
        assert torch.allclose(torch.tensor(alone, dtype=torch.float64), got, atol=1e-5)
    assert outs[-1].outputs[0].token_ids == alone_gen  # the generation beside them is unchanged
    # Its blocks are cached now (mean pooling computes them all the same).
    (again,) = llm.embed([ids[0]], pooling)
    assert torch.allclose(torch.tensor(again), torch.tensor(outs[0].embedding), atol=1e-5)


def test_a_pooling_request_must_generate_nothing():
    with pytest.raises(ValueError, match="generates nothing"):
        SamplingParams(max_tokens=4, pooling="mean")
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=0, pooling="cls")


@pytest.fixture(scope="module")
def server():
    s = start_server("--embedding-pooling", "mean", "--kv-cache-memory", "128MiB", "--threads", "1")
    yield s
    s.stop()


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)


def test_the_embeddings_route_speaks_openai(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    # The SDK asks for base64 unless told otherwise, and decodes it.
    sdk = client.embeddings.create(model=MODEL, input=TEXTS)
    floats = post(server.url, {"input": TEXTS}).json()
    assert [d["index"] for d in floats["data"]] == [0, 1, 2] and floats["object"] == "list"
    for d, e in zip(floats["data"], sdk.data):
        assert d["object"] == "embedding" and len(d["embedding"]) == 576
        assert torch.allclose(torch.tensor(d["embedding"]), torch.tensor(e.embedding), atol=1e-6)
    raw = post(server.url, {"input": TEXTS[1], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    unpacked = struct.unpack("<576f", base64.b64decode(raw))
    assert torch.allclose(torch.tensor(unpacked), torch.tensor(floats["data"][1]["embedding"]), atol=1e-6)
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    by_ids = post(server.url, {"input": [tokens]}).json()
    assert by_ids["data"][0]["embedding"] == floats["data"][1]["embedding"]
    assert by_ids["usage"] == {"prompt_tokens": len(tokens), "total_tokens": len(tokens)}
    cut = post(server.url, {"input": TEXTS[1], "dimensions": 64}).json()["data"][0]["embedding"]
    full = torch.tensor(floats["data"][1]["embedding"], dtype=torch.float64)
    assert torch.allclose(torch.tensor(cut, dtype=torch.float64), F.normalize(full[:64], dim=0), atol=1e-6)


def test_an_embedding_runs_beside_a_stream_without_changing_it(server):
    body = {"model": MODEL, "prompt": "Write about the sea.", "max_tokens": 48, "temperature": 0}
    body["ignore_eos"] = True
    alone = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    want = post(server.url, {"input": TEXTS}).json()["data"]
    with ThreadPoolExecutor(4) as pool:
        gen = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60)
        embeds = [pool.submit(post, server.url, {"input": TEXTS}) for _ in range(3)]
        assert gen.result().json()["choices"][0]["text"] == alone
        for e in embeds:
            for got, ref in zip(e.result().json()["data"], want):
                got, ref = torch.tensor(got["embedding"]), torch.tensor(ref["embedding"])
                assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "x", "dimensions": 10_000}, "dimensions"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [1, 2, 10**9]}, None),  # a token id past the vocabulary
        ({"input": 3}, "input"),
    ],
)
def test_bad_embedding_input_is_refused_and_leaves_nothing(server, body, param):
    r = post(server.url, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"].split(".")[0] == param
    server.wait_idle()  # nothing runs, nothing waits, every KV block is free
    assert post(server.url, {"input": "still fine"}).status_code == 200


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_random_checkpoints_embed_as_hf_and_their_pooling_config_is_read(arch, tmp_path):
    hf = make_random_checkpoint(arch, tmp_path)
    assert load_hf_config(tmp_path).pooling is None
    (tmp_path / "1_Pooling").mkdir()  # sentence-transformers' pooling config beside the weights
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert load_hf_config(tmp_path).pooling == "mean"
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (3, 40, 90)]
    with LLM(str(tmp_path), num_blocks=64, max_num_batched_tokens=32) as llm:
        for pooling in ("mean", "last"):
            for prompt, got in zip(prompts, llm.embed(prompts, pooling)):
                want = hf_embedding(hf, prompt, pooling)
                assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, atol=1e-4), pooling


def test_a_prompt_computed_again_is_pooled_once():
    """A retried step or a preempted request's second pass replaces the sums it made before."""
    pooler = PromptPooler(lambda rows: rows)
    rows = torch.arange(12, dtype=torch.float64).reshape(6, 2)
    want = F.normalize(rows.mean(0), dim=0)
    pooler.add("r", "mean")
    assert pooler.take("r", rows[0:2], 0, 6) is None
    assert pooler.take("r", rows[2:4], 2, 6) is None
    assert pooler.take("r", rows[2:4], 2, 6) is None  # the same step again
    assert pooler.take("r", rows[0:3], 0, 6) is None  # preempted: from the start, other chunks
    assert torch.allclose(torch.tensor(pooler.take("r", rows[3:6], 3, 6), dtype=torch.float64), want)
    assert not pooler.sums
