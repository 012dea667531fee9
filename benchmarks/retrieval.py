"""Vector search for retrieval (issue 32), in one run:

1. one shard of N vectors of the model's width (576): for flat, IVF-PQ (exact refine) and HNSW,
   each at two search settings: build time, index memory, recall@10 against brute force, and
   queries per second one query at a time (as a router sends them);
2. the same HNSW index split over 1, 2 and 4 shards, each its own `shoal index serve` process,
   queried through the gateway's scatter-gather router: QPS and latency p50/p99;
3. two replicas of one shard, one of them slow on a share of its searches: latency p50/p99/max
   through the router without hedging and with it.

The vectors are a mixture of Gaussian clusters (embeddings cluster by topic), unit-normalized;
the queries come from the same mixture. Goal: recall@10 >= 0.95 at >= 10x the QPS of flat.

    python benchmarks/retrieval.py [--n 1000000] [--dim 576] [--queries 300] [--sharded-n N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from shoal.retrieval import faiss_lib
from shoal.retrieval.router import RetrievalIndexConfig, RetrievalRouter
from shoal.retrieval.server import SEARCH_DELAY_ENV, SEARCH_DELAY_SHARE_ENV
from shoal.retrieval.shard import IndexShard, IndexSpec, SearchParams, unit_rows

SETTINGS = {
    "flat": [SearchParams()],
    "ivfpq": [SearchParams(nprobe=8, k_factor=8), SearchParams(nprobe=32, k_factor=16)],
    "hnsw": [SearchParams(ef_search=32), SearchParams(ef_search=128)],
}


def mixture(rng, n: int, dim: int, centers: np.ndarray) -> np.ndarray:
    out = np.empty((n, dim), dtype=np.float32)
    for lo in range(0, n, 100_000):
        k = min(100_000, n - lo)
        picks = centers[rng.integers(0, len(centers), k)]
        out[lo : lo + k] = picks + 0.6 * rng.standard_normal((k, dim), dtype=np.float32)
    return unit_rows(out)


def one_at_a_time(shard: IndexShard, queries: np.ndarray, params: SearchParams) -> tuple[float, list]:
    found, t0 = [], time.perf_counter()
    for q in queries:
        found += shard.search(q[None], 10, params)
    return len(queries) / (time.perf_counter() - t0), found


def index_bytes(shard: IndexShard) -> int:
    return len(faiss_lib().serialize_index(shard.index))


def single_shard(vectors, docs, queries, truth, only: list[str]) -> None:
    print(
        f"\n1. one shard, {len(vectors):,} vectors of width {vectors.shape[1]}, "
        f"{len(queries)} queries one at a time"
    )
    print(f"{'index':<28}{'setting':<22}{'build s':>9}{'MiB':>9}{'recall@10':>11}{'QPS':>9}{'x flat':>8}")
    flat_qps = None
    for kind in only:
        t0 = time.perf_counter()
        shard = IndexShard.build(vectors, docs, IndexSpec(kind))
        built = time.perf_counter() - t0
        mib = index_bytes(shard) / 2**20
        for params in SETTINGS[kind]:
            qps, found = one_at_a_time(shard, queries, params)
            hits = [len({h.id for h in f} & set(t)) / 10 for f, t in zip(found, truth)]
            flat_qps = flat_qps or qps
            setting = {
                "flat": "exact",
                "ivfpq": f"nprobe {params.nprobe}, k_factor {params.k_factor}",
                "hnsw": f"efSearch {params.ef_search}",
            }[kind]
            factory = shard.spec.factory(shard.dim, shard.count)
            print(
                f"{factory:<28}{setting:<22}{built:>9.1f}{mib:>9.0f}{np.mean(hits):>11.3f}{qps:>9.0f}"
                f"{qps / flat_qps:>8.1f}"
            )
        del shard


def serve(folder: Path, port: int, env: dict | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shoal.cli", "index", "serve", str(folder), "--port", str(port)]
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the shard server on {port} did not start")
        time.sleep(0.2)


async def through_router(config: RetrievalIndexConfig, queries: np.ndarray) -> list[float]:
    async with httpx.AsyncClient(timeout=30) as http:
        router = RetrievalRouter(config, http)
        times = []
        for q in queries:
            t0 = time.perf_counter()
            got = await router.search(q.tolist(), 10)
            times.append(time.perf_counter() - t0)
            assert not got.partial
        return times


def pct(times: list[float], p: float) -> float:
    return sorted(times)[min(len(times) - 1, int(p * len(times)))] * 1000


def sharded(vectors, docs, queries, root: Path, port: int) -> None:
    print("\n2. HNSW (efSearch 64) split over shards, each a `shoal index serve` process, through the router")
    print(f"{'shards':>7}{'build s':>9}{'QPS':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for count in (1, 2, 4):
        t0 = time.perf_counter()
        folders = []
        for s in range(count):
            rows = np.arange(s, len(vectors), count)
            shard = IndexShard.build(vectors[rows], [docs[i] for i in rows], IndexSpec("hnsw"), f"shard-{s}")
            shard.save(root / f"{count}-{s}")
            folders.append(root / f"{count}-{s}")
            del shard
        built = time.perf_counter() - t0
        procs = [serve(f, port + i) for i, f in enumerate(folders)]
        try:
            cfg = RetrievalIndexConfig(
                "bench",
                [[f"http://127.0.0.1:{port + i}"] for i in range(count)],
                budget_ms=10_000,
                hedge_ms=0,
                search={"ef_search": 64},
            )
            asyncio.run(through_router(cfg, queries[:20]))  # warm
            t0 = time.perf_counter()
            times = asyncio.run(through_router(cfg, queries))
            qps = len(queries) / (time.perf_counter() - t0)
            print(f"{count:>7}{built:>9.1f}{qps:>8.0f}{pct(times, 0.5):>9.1f}{pct(times, 0.99):>9.1f}")
        finally:
            for p in procs:
                p.terminate()
                p.wait()


def hedging(root: Path, queries: np.ndarray, port: int, delay_s: float, share: float) -> None:
    print(f"\n3. two replicas of one shard, one {delay_s * 1000:.0f} ms late on {share:.0%} of its searches")
    print(f"{'router':<28}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    slow = {SEARCH_DELAY_ENV: str(delay_s), SEARCH_DELAY_SHARE_ENV: str(share)}
    procs = [serve(root / "1-0", port), serve(root / "1-0", port + 1, slow)]
    try:
        urls = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port}"]  # the slow one first
        for label, hedge_ms in (("no hedging", 0.0), ("hedge after 20 ms", 20.0)):
            cfg = RetrievalIndexConfig(
                "bench", [urls], budget_ms=10_000, hedge_ms=hedge_ms, search={"ef_search": 64}
            )
            times = asyncio.run(through_router(cfg, queries))
            print(f"{label:<28}{pct(times, 0.5):>9.1f}{pct(times, 0.99):>9.1f}{max(times) * 1000:>9.1f}")
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--sharded-n", type=int, default=0, help="vectors for parts 2 and 3 (default: --n)")
    ap.add_argument("--kinds", default="flat,ivfpq,hnsw")
    ap.add_argument("--port", type=int, default=8190)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((max(64, args.n // 1000), args.dim), dtype=np.float32)
    vectors = mixture(rng, args.n, args.dim, centers)
    queries = mixture(rng, args.queries, args.dim, centers)
    docs = [{"id": str(i)} for i in range(args.n)]
    t0 = time.perf_counter()
    exact = IndexShard.build(vectors, docs, IndexSpec("flat")).search(queries, 10)
    truth = [[h.id for h in row] for row in exact]
    print(f"machine: {os.cpu_count()} cores; brute-force truth in {time.perf_counter() - t0:.1f} s")
    single_shard(vectors, docs, queries, truth, args.kinds.split(","))
    if args.sharded_n and args.sharded_n < args.n:
        vectors, docs = vectors[: args.sharded_n], docs[: args.sharded_n]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sharded(vectors, docs, queries, root, args.port)
        hedging(root, queries, args.port + 10, delay_s=0.2, share=0.2)


if __name__ == "__main__":
    main()
