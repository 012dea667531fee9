"""Retrieval on real faiss shards, real shard servers and a real gateway: recall@10 of each index
kind against brute force on a clustered synthetic set, shards reloaded from their files answering
identically, a query scattered over two shards of two replicas each and merged exactly, a replica
killed under query load (answers stay whole), a slow replica hedged, a shard that misses the
budget (the answer comes in time, marked partial), and chat answers grounded in passages that
the model's own embeddings found, in a stable order whose K/V the next request reuses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from shoal.retrieval.build import shard_of
from shoal.retrieval.server import SEARCH_DELAY_ENV
from shoal.retrieval.shard import IndexShard, IndexSpec, SearchParams, unit_rows
from tests.fleet_helpers import metric, start_gateway, wait_until
from tests.server_helpers import ServerProcess, free_port, wait_ready

pytest.importorskip("faiss")

DIM, COUNT, QUERIES = 32, 6000, 100
MODEL = "SmolLM2-135M-Instruct"


def clustered(rng, n: int) -> np.ndarray:
    centers = np.random.default_rng(1).normal(size=(60, DIM))
    return (centers[rng.integers(0, 60, n)] + 0.35 * rng.normal(size=(n, DIM))).astype(np.float32)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    vectors, queries = clustered(rng, COUNT), clustered(rng, QUERIES)
    scores = unit_rows(queries) @ unit_rows(vectors).T  # the exact answer, by brute force
    truth = [[f"doc-{i}" for i in row] for row in np.argsort(-scores, axis=1)[:, :10]]
    return vectors, queries, truth


def recall(found, truth) -> float:
    return float(np.mean([len({h.id for h in f} & set(t)) / len(t) for f, t in zip(found, truth)]))


@pytest.mark.parametrize(
    "spec, params, at_least",
    [
        (IndexSpec("flat"), SearchParams(), 1.0),
        (IndexSpec("hnsw", hnsw_m=16), SearchParams(ef_search=64), 0.95),
        (IndexSpec("ivfpq", nlist=64), SearchParams(nprobe=16, k_factor=8), 0.95),
    ],
    ids=["flat", "hnsw", "ivfpq"],
)
def test_recall_at_10_against_brute_force_and_reloaded_identical(data, tmp_path, spec, params, at_least):
    vectors, queries, truth = data
    docs = [{"id": f"doc-{i}", "text": f"text {i}", "metadata": {"n": i}} for i in range(COUNT)]
    shard = IndexShard.build(vectors, docs, spec)
    found = shard.search(queries, 10, params)
    assert recall(found, truth) >= at_least
    assert all(h.text == f"text {h.metadata['n']}" for row in found for h in row)
    shard.save(tmp_path / "shard", vectors)
    again = IndexShard.load(tmp_path / "shard")
    assert again.search(queries, 10, params) == found
    assert again.exact(queries[:5], 10) == truth[:5]  # the recall probe's brute force


def write_jsonl(path, docs) -> None:
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")


def shoal(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "shoal.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def index_server(folder, env: dict | None = None) -> ServerProcess:
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="shoal-index-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "index", "serve", str(folder), "--port", str(port)],
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
    wait_ready(server, 60)
    return server


@pytest.fixture(scope="module")
def shards(data, tmp_path_factory):
    """Two flat shards built by `shoal index build`, each served by two replicas; the second
    shard's second replica answers a second late."""
    vectors, _, _ = data
    root = tmp_path_factory.mktemp("index")
    write_jsonl(
        root / "docs.jsonl", [{"id": f"doc-{i}", "vector": v.tolist()} for i, v in enumerate(vectors)]
    )
    shoal(
        "index",
        "build",
        "--input",
        str(root / "docs.jsonl"),
        "--out",
        str(root / "out"),
        "--shards",
        "2",
        "--kind",
        "flat",
    )
    servers = [
        [index_server(root / "out" / "shard-0"), index_server(root / "out" / "shard-0")],
        [
            index_server(root / "out" / "shard-1"),
            index_server(root / "out" / "shard-1", {SEARCH_DELAY_ENV: "1.0"}),
        ],
    ]
    yield servers
    for s in servers:
        for r in s:
            r.stop()


def gateway_with(tmp_path, backends: list[str], **index) -> ServerProcess:
    """A gateway over `backends` (a model's replicas: a gateway needs one) with one index."""
    conf = tmp_path / f"gateway-{time.monotonic_ns()}.toml"
    table = {"name": "vecs", **index}
    lines = ["[[retrieval]]"] + [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    conf.write_text("\n".join(lines) + "\n")
    return start_gateway(backends, "--config", str(conf))


def retrieve(gw, vector, top_k=10) -> dict:
    r = httpx.post(
        gw.url + "/v1/retrieve", json={"index": "vecs", "vector": vector, "top_k": top_k}, timeout=30
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_two_shards_merged_exactly_and_a_slow_replica_hedged(data, shards, tmp_path, chat_server):
    _, queries, truth = data
    urls = [[r.url for r in s] for s in shards]
    gw = gateway_with(tmp_path, [chat_server.url], shards=urls, budget_ms=3000, hedge_ms=100)
    try:
        t0 = time.monotonic()
        answers = [retrieve(gw, q.tolist()) for q in queries[:20]]
        took = time.monotonic() - t0
        for a, t in zip(answers, truth):
            assert not a["partial"] and [h["id"] for h in a["data"]] == t
        # Every query found the slow replica slow at most once; hedged, none waited for it.
        assert took < 20 * 0.5, took
        assert metric(gw.url, "shoal:gateway_retrieval_hedges_total") >= 1
    finally:
        gw.stop()


def test_a_replica_killed_under_query_load_leaves_answers_whole(data, shards, tmp_path, chat_server):
    _, queries, truth = data
    urls = [[r.url for r in s] for s in shards]
    urls[1] = urls[1][:1]  # (not the slow one here)
    gw = gateway_with(tmp_path, [chat_server.url], shards=urls, budget_ms=3000, hedge_ms=0)
    victim = shards[0][0]
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(retrieve, gw, q.tolist()) for q in np.repeat(queries[:20], 4, axis=0)]
            time.sleep(0.2)
            victim.proc.send_signal(signal.SIGKILL)
            answers = [f.result() for f in futures]
        for a, t in zip(answers, np.repeat(np.array(truth[:20], dtype=object), 4, axis=0)):
            assert not a["partial"] and [h["id"] for h in a["data"]] == list(t)
        after = retrieve(gw, queries[0].tolist())
        assert not after["partial"] and [h["id"] for h in after["data"]] == truth[0]
        # The probes see it gone, and its shard's other replica up.
        up = 'shoal:gateway_retrieval_replica_up{{index="vecs",replica="{}",shard="0"'
        wait_until(gw, lambda: metric(gw.url, up.format(victim.url)) == 0, 10)
        assert metric(gw.url, up.format(shards[0][1].url)) == 1
    finally:
        gw.stop()


def test_a_shard_that_misses_the_budget_gives_a_partial_answer_in_time(data, shards, tmp_path, chat_server):
    _, queries, truth = data
    urls = [[shards[0][1].url], [shards[1][1].url]]  # shard 1's only replica is the slow one
    gw = gateway_with(tmp_path, [chat_server.url], shards=urls, budget_ms=300, hedge_ms=0)
    try:
        t0 = time.monotonic()
        a = retrieve(gw, queries[0].tolist())
        assert time.monotonic() - t0 < 0.9
        assert a["partial"] and a["missed_shards"] == [1]
        want = [i for i in truth[0] if shard_of(i, 2) == 0]
        assert [h["id"] for h in a["data"]][: len(want)] == want  # shard 0's best, in order
        assert metric(gw.url, 'shoal:gateway_retrieval_queries_total{answer="partial"') == 1
    finally:
        gw.stop()


def test_a_shard_probes_its_own_recall(shards, tmp_path):
    folder = shards_folder(shards)
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="shoal-index-", suffix=".log")
    argv = [sys.executable, "-m", "shoal.cli", "index", "serve", folder, "--port", str(port)]
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            [*argv, "--recall-probe-interval", "0.2"], stdout=log, stderr=subprocess.STDOUT
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_ready(server, 60)
        deadline = time.monotonic() + 30
        while metric(server.url, "shoal:index_recall_at_10") == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(server.url, "shoal:index_recall_at_10") == 1.0  # flat: exact
    finally:
        server.stop()


def shards_folder(shards) -> str:
    """The folder shard 0's first server was started on (its command line says)."""
    return shards[0][1].proc.args[5]


DOCS = [
    {"id": "a-penguins", "text": "Penguins live in the southern hemisphere, mostly in Antarctica."},
    {"id": "b-volcanoes", "text": "Volcanoes form where magma rises through the crust of the earth."},
    {"id": "c-violins", "text": "A violin has four strings and is played with a bow."},
]


def test_chat_grounded_in_retrieved_passages_reuses_their_kv(chat_server, tmp_path):
    write_jsonl(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "out"
    build = ["--input", str(tmp_path / "docs.jsonl"), "--out", str(out), "--kind", "flat"]
    shoal("index", "build", *build, "--embed-url", chat_server.url, "--embed-model", MODEL)
    shard = index_server(out / "shard-0")
    gw = gateway_with(tmp_path, [chat_server.url], name="docs", shards=[[shard.url]], top_k=3, hedge_ms=0)
    try:
        question = "Where do penguins live?"
        # The passages /v1/retrieve finds are the nearest by the model's own embeddings.
        embed = httpx.post(
            chat_server.url + "/v1/embeddings",
            json={"model": MODEL, "input": [question, *(d["text"] for d in DOCS)]},
            timeout=60,
        ).json()["data"]
        q, docs = np.array(embed[0]["embedding"]), np.array([e["embedding"] for e in embed[1:]])
        nearest = [DOCS[i]["id"] for i in np.argsort(-(docs @ q))]
        body = {"index": "docs", "input": question, "model": MODEL, "top_k": 2}
        found = httpx.post(gw.url + "/v1/retrieve", json=body, timeout=60).json()
        assert [h["id"] for h in found["data"]] == nearest[:2] and not found["partial"]

        def chat(text: str, **extra) -> dict:
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 12}
            return body | {"temperature": 0, "retrieval": {"index": "docs"}, **extra}

        def grounded(text: str, **extra) -> httpx.Response:
            return httpx.post(gw.url + "/v1/chat/completions", json=chat(text, **extra), timeout=120)

        first = grounded(question)
        assert first.status_code == 200, first.text
        note = first.json()["retrieval"]
        assert [p["id"] for p in note["passages"]] == sorted(d["id"] for d in DOCS)  # by id, not score
        assert json.loads(first.headers["x-shoal-retrieval"]) == note
        # What the model was given: the passages, numbered in that order, before the question.
        block = "Passages retrieved for this conversation; cite them by number:\n\n" + "\n\n".join(
            f"[{n}] {d['text']}" for n, d in enumerate(sorted(DOCS, key=lambda d: d["id"]), 1)
        )
        messages = [{"role": "system", "content": block}, {"role": "user", "content": question}]
        direct = httpx.post(
            chat_server.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0},
            timeout=120,
        ).json()
        assert first.json()["choices"][0]["message"] == direct["choices"][0]["message"]
        assert first.json()["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
        # Another question that retrieves the same passages finds their K/V cached.
        second = grounded("Which instrument has a bow?")
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 48, second.json()["usage"]
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=chat(question, stream=True)) as r:
            assert r.status_code == 200 and json.loads(r.headers["x-shoal-retrieval"]) == note
            r.read()
        bad = grounded(question, retrieval={"index": "nope"})
        assert bad.status_code == 404 and bad.json()["error"]["param"] == "index"
    finally:
        gw.stop()
        shard.stop()
