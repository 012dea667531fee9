"""Returning conversations whose K/V no longer fits one replica's pool (issue 29): TTFT of the
returning turns with no offload tier, with the host-memory tier, with host memory and disk, and
with disk alone; on two replicas behind a gateway that alternates between them (each
conversation returns to the other replica), with and without fetching the prefix from the peer
that holds it; and what loading a block costs against computing it, by tier.

Each conversation opens with a shared system prompt and a long document of its own, and gets a
short reply. Once every conversation has opened (far more K/V than the pool holds: each one
pushes the ones before it out), each comes back with its history and a short follow-up, one at a
time, and the time to its first token is measured. The bundled model, int4, streamed chat.

    python benchmarks/kv_tiers.py [--conversations 12] [--document 600] [--pool 48MiB]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from llama_cpp_server import wait_until_ok  # this script's folder is on sys.path
from serve_throughput import shoal_server

from shoal.bench.multiturn import MultiTurnConfig, chat_turn
from shoal.bench.workload import exact_length_text
from shoal.models.checkpoint import load_tokenizer

PORT = 8141


def metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


@contextlib.contextmanager
def two_replicas(
    pool: str,
    peer_fetch: bool,
    folder: Path,
    policy: str = "round_robin",
    more: tuple[str, ...] = (),
    seqs: int = 0,
):
    """`shoal fleet up` of two replicas with `pool` each (and `seqs` sequences at most), requests
    alternating between them (or as `policy` says); `more`: further flags of the fleet's."""
    config = folder / f"fleet-{peer_fetch}.toml"
    config.write_text(f"[gateway]\npeer_fetch_min_tokens = {128 if peer_fetch else 0}\n")
    replica_args = f"--kv-cache-memory {pool} --threads 1" + (f" --max-num-seqs {seqs}" if seqs else "")
    cmd = [sys.executable, "-m", "shoal.cli", "fleet", "up", "--replicas", "2", "--base-port", "0",
           "--port", str(PORT), "--policy", policy, "--replica-args", replica_args,
           "--config", str(config), *more]  # fmt: skip
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{PORT}"
    try:
        wait_until_ok(url + "/ready", proc, "shoal fleet up", timeout=300)
        deadline = time.monotonic() + 300
        while sum(r["state"] == "ready" for r in httpx.get(url + "/replicas").json()["replicas"]) < 2:
            assert time.monotonic() < deadline, "the replicas did not come up"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


async def conversations(url: str, n: int, document: int, seed: int) -> list[float]:
    """TTFT (s) of each conversation's returning turn."""
    tok = load_tokenizer(None)
    rng = random.Random(seed)
    system = exact_length_text(tok, 200, rng)
    docs = [exact_length_text(tok, document, rng) for _ in range(n)]
    follow = [exact_length_text(tok, 40, rng) for _ in range(n)]
    cfg = MultiTurnConfig(base_url=url, output_len=16)
    histories = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for doc in docs:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": doc}]
            rec, reply = await chat_turn(client, model, messages, cfg, 0.0, 0)
            assert rec.ok, rec.error
            histories.append([*messages, {"role": "assistant", "content": reply}])
        if n % 2 == 0:  # behind a gateway alternating between two replicas: come back to the other
            await chat_turn(client, model, [{"role": "user", "content": "Hello"}], cfg, 0.0, 0)
        ttfts = []
        for history, question in zip(histories, follow):
            rec, _ = await chat_turn(
                client, model, [*history, {"role": "user", "content": question}], cfg, 0.0, 0
            )
            assert rec.ok, rec.error
            ttfts.append(rec.ttft)
    return ttfts


def summary(ttfts: list[float]) -> tuple[float, float]:
    """p50 and p99 in ms."""
    p99 = statistics.quantiles(ttfts, n=100)[98] if len(ttfts) > 1 else ttfts[0]
    return 1000 * statistics.median(ttfts), 1000 * p99


def block_costs(disk: str) -> dict[str, float]:
    """Seconds to load one block from each tier and to compute it, as the engine times them at start."""
    from shoal.llm import LLM

    llm = LLM(kv_offload_memory=64 << 20, kv_offload_disk=(disk, "256MiB"))
    try:
        return dict(llm.engine.core.kv.tiers.costs)
    finally:
        llm.engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--document", type=int, default=600, help="tokens of each conversation's document")
    ap.add_argument("--pool", default="48MiB", help="the replica's KV pool")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-tiers-") as disk:
        setups = [
            ("no tier", []),
            ("host memory 1GiB", ["--kv-offload-memory", "1GiB"]),
            ("host 64MiB + disk", ["--kv-offload-memory", "64MiB", "--kv-offload-disk", disk, "2GiB"]),
            ("disk only", ["--kv-offload-disk", disk, "2GiB"]),
        ]
        for name, flags in setups:
            with shoal_server(PORT, "auto", extra=("--kv-cache-memory", args.pool, *flags)) as url:
                ttfts = asyncio.run(conversations(url, args.conversations, args.document, args.seed))
                hits = metric(url, "shoal:prefix_cache_hits_total") / metric(
                    url, "shoal:prefix_cache_queries_total"
                )
                loaded = metric(url, "shoal:kv_offload_loaded_blocks_total")
            rows.append((name, *summary(ttfts), hits, loaded))
        # Two replicas whose pools hold every conversation; each comes back to the other replica.
        for peer_fetch in (False, True):
            with two_replicas("1GiB", peer_fetch, Path(disk)) as url:
                ttfts = asyncio.run(conversations(url, args.conversations, args.document, args.seed))
                fetched = metric(url, 'shoal:gateway_disagg_decisions_total{decision="peer_fetch"')
            name = "2 replicas, " + ("prefix fetched from the peer" if peer_fetch else "no peer fetch")
            rows.append((name, *summary(ttfts), None, fetched))
        costs = block_costs(disk)
    print(f"\n{args.conversations} conversations of a {args.document}-token document, pool {args.pool}; "
          "returning turns one at a time")  # fmt: skip
    print("| setup | returning TTFT p50 ms | p99 ms | prefix hit rate | blocks from tiers (or fetches) |")
    print("| --- | --- | --- | --- | --- |")
    for name, p50, p99, hits, loaded in rows:
        shown = "-" if hits is None else f"{hits:.2f}"
        print(f"| {name} | {p50:.0f} | {p99:.0f} | {shown} | {loaded:.0f} |")
    base = rows[0][1]
    for name, p50, *_ in rows[1:4]:
        print(f"{name}: returning TTFT p50 {base / p50:.1f}x better than no tier")
    print(f"peer fetch: returning TTFT p50 {rows[4][1] / rows[5][1]:.1f}x better than computing the prefix")
    print("one block (16 tokens): " + ", ".join(f"{t} {1000 * s:.2f} ms" for t, s in costs.items()))


if __name__ == "__main__":
    main()
