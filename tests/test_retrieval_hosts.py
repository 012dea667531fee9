"""Index shards on two test hosts (shoal.testing.hosts), a gateway here scattering over them: the
answer is the brute-force one; with one host's link cut, it comes back within the latency budget,
marked partial with that host's shard; with the link restored, whole again."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import pytest

from shoal.retrieval.shard import IndexShard, IndexSpec, unit_rows
from tests.cross_host_helpers import host_cluster
from tests.server_helpers import ServerProcess, wait_ready
from tests.test_retrieval import gateway_with

pytest.importorskip("faiss")

PORT = 8100  # each host its own network namespace: no one else's port
DIM, COUNT = 24, 4000


@pytest.fixture(scope="module")
def cluster():
    with host_cluster(2) as c:
        yield c


def shard_server(host, folder) -> ServerProcess:
    fd, log_path = tempfile.mkstemp(prefix=f"shoal-index-{host.name}-", suffix=".log")
    argv = [sys.executable, "-m", "shoal.cli", "index", "serve", str(folder), "--host", host.address]
    with os.fdopen(fd, "w") as log:
        proc = host.run(
            [*argv, "--port", str(PORT)], env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT
        )
    return ServerProcess(f"http://{host.address}:{PORT}", proc, log_path)


def test_shards_on_two_hosts_answer_whole_then_partial_when_one_is_cut_off(cluster, chat_server, tmp_path):
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(COUNT, DIM)).astype(np.float32)
    halves = [range(0, COUNT, 2), range(1, COUNT, 2)]
    for s, rows in enumerate(halves):
        docs = [{"id": f"doc-{i}"} for i in rows]
        IndexShard.build(vectors[list(rows)], docs, IndexSpec("flat"), f"shard-{s}").save(
            tmp_path / f"shard-{s}"
        )
    servers = [shard_server(h, tmp_path / f"shard-{s}") for s, h in enumerate(cluster.hosts)]
    gw = None
    try:
        for s in servers:
            wait_ready(s, 60)
        urls = [[s.url] for s in servers]
        gw = gateway_with(tmp_path, [chat_server.url], shards=urls, budget_ms=500, hedge_ms=0, down_s=0.5)
        query = rng.normal(size=DIM).astype(np.float32)
        exact = [f"doc-{i}" for i in np.argsort(-(unit_rows(vectors) @ unit_rows(query[None])[0]))[:10]]

        def ask() -> tuple[dict, float]:
            t0 = time.monotonic()
            body = {"index": "vecs", "vector": query.tolist(), "top_k": 10}
            r = httpx.post(gw.url + "/v1/retrieve", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.json(), time.monotonic() - t0

        whole, _ = ask()
        assert not whole["partial"] and [h["id"] for h in whole["data"]] == exact
        cluster.hosts[1].cut()
        cut, took = ask()
        assert took < 1.5, took  # the budget, not a TCP timeout
        assert cut["partial"] and cut["missed_shards"] == [1]
        held = [i for i in exact if int(i.split("-")[1]) % 2 == 0]  # shard 0's of the true ten
        assert [h["id"] for h in cut["data"]][: len(held)] == held
        cluster.hosts[1].restore()
        deadline = time.monotonic() + 20
        while (again := ask()[0])["partial"]:
            assert time.monotonic() < deadline, again
            time.sleep(0.2)
        assert [h["id"] for h in again["data"]] == exact
    finally:
        if gw is not None:
            gw.stop()
        for s in servers:
            s.stop()
