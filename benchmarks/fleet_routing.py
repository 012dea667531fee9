"""Issue 4's two fleet benchmarks, on real processes.

(a) Multi-turn chat over 3 replicas: `kv_aware` (the `shoal fleet up` gateway) against
    `round_robin` (a `shoal gateway` over the same replicas): TTFT p50/p99, throughput and the
    replicas' prefix-cache hit rate. Each policy gets its own seed, so neither finds the other's
    conversations in the caches.
(b) Gateway overhead: the same `shoal bench serve` load straight to one replica and through a
    gateway that fronts only that replica, alternated over several rounds.

    python benchmarks/fleet_routing.py        # both; `a` or `b` for one
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import httpx

from shoal.bench.multiturn import MultiTurnConfig, run_multiturn
from shoal.bench.serve import ServeBenchConfig, run_serve_bench
from shoal.sim.servers import spawn_shoal

REPLICA_ARGS = "--threads 1 --kv-cache-memory 1GiB"


def spawn(*args: str, env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen]:
    """`shoal ARGS` on a free port, its output in a log of its own; its state folder (spawn_shoal)
    is removed with the process object."""
    fd, _ = tempfile.mkstemp(prefix="shoal-bench-", suffix=".log")
    with os.fdopen(fd, "w") as log:  # the child keeps its own copy of the descriptor
        url, proc, state = spawn_shoal(list(args), env, stdout=log)
    weakref.finalize(proc, state.cleanup)
    return url, proc


def wait_ready(url: str, count: int) -> list[dict]:
    for _ in range(1200):
        try:
            reps = httpx.get(url + "/replicas", timeout=2).json()["replicas"]
            if sum(r["state"] == "ready" for r in reps) >= count:
                return reps
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{url}: replicas not ready")


class ReplicaSampler:
    """Counts the replicas loaded (a process up, not down) every 0.5 s while a run goes on."""

    def __init__(self, url: str):
        self.url = url
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                try:
                    reps = client.get(self.url + "/replicas").json()["replicas"]
                    loaded = sum(r["pid"] is not None and r["state"] != "down" for r in reps)
                    self.samples.append((time.perf_counter(), loaded))
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                self._stop.wait(0.5)

    def replica_seconds(self) -> float:
        return sum((b[0] - a[0]) * a[1] for a, b in itertools.pairwise(self.samples))


def prefix_counts(replica_urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in replica_urls:
        for line in httpx.get(u + "/metrics", timeout=10).text.splitlines():
            if line.startswith("shoal:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("shoal:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def report_overhead(conc: int, results: dict[str, list[dict]]) -> None:
    def med(name, key, stat="p50"):
        return statistics.median(r[key][stat] for r in results[name])

    def thr(name):
        return statistics.median(r["output_token_throughput"] for r in results[name])

    print(f"\nconcurrency {conc} (medians over the rounds)")
    print("| path | TTFT p50 ms | E2E p50 ms | ITL p50 ms | output tok/s |")
    print("| --- | --- | --- | --- | --- |")
    for name in results:
        ttft, e2e, itl = (1000 * med(name, k) for k in ("ttft_s", "e2e_s", "itl_s"))
        print(f"| {name} | {ttft:.1f} | {e2e:.1f} | {itl:.2f} | {thr(name):.1f} |")
    added_ttft = 1000 * (med("gateway", "ttft_s") - med("direct", "ttft_s"))
    added_e2e = 1000 * (med("gateway", "e2e_s") - med("direct", "e2e_s"))
    print(
        f"added TTFT p50: {added_ttft:.2f} ms; added E2E p50: {added_e2e:.2f} ms; "
        f"throughput ratio {thr('gateway') / thr('direct'):.3f}"
    )


def main() -> None:
    parts = sys.argv[1:] or ["a", "b"]
    procs = []
    try:
        fleet_url, p = spawn(
            "fleet", "up", "--replicas", "3", "--base-port", "0", "--replica-args", REPLICA_ARGS
        )
        procs.append(p)
        reps = wait_ready(fleet_url, 3)
        urls = [r["url"] for r in reps]
        rr_url, p = spawn("gateway", "--policy", "round_robin", *[f for u in urls for f in ("--backend", u)])
        procs.append(p)
        wait_ready(rr_url, 3)
        for u in urls:  # first requests pay one-off costs
            httpx.post(
                u + "/v1/completions",
                json={"model": "SmolLM2-135M-Instruct", "prompt": "warm up", "max_tokens": 4},
                timeout=120,
            )

        if "a" in parts:
            multi_turn(fleet_url, rr_url, urls)
        if "b" in parts:
            overhead(urls[0], procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def multi_turn(fleet_url: str, rr_url: str, urls: list[str]) -> None:
    print("== (a) multi-turn chat, 3 replicas")
    rows = {}
    for policy, url, seed in (("round_robin", rr_url, 1), ("kv_aware", fleet_url, 2)):
        h0, q0 = prefix_counts(urls)
        s = run_multiturn(MultiTurnConfig(base_url=url, seed=seed))
        h1, q1 = prefix_counts(urls)
        rows[policy] = (s, (h1 - h0) / max(1.0, q1 - q0))
    print("\n| policy | TTFT p50 ms | TTFT p99 ms | output tok/s | req/s | prefix hit rate |")
    print("| --- | --- | --- | --- | --- | --- |")
    for policy, (s, hit) in rows.items():
        print(
            f"| {policy} | {1000 * s['ttft_s']['p50']:.0f} | {1000 * s['ttft_s']['p99']:.0f} | "
            f"{s['output_token_throughput']:.1f} | {s['request_throughput']:.2f} | {100 * hit:.1f}% |"
        )
    ratio = rows["round_robin"][0]["ttft_s"]["p50"] / rows["kv_aware"][0]["ttft_s"]["p50"]
    print(f"TTFT p50 round_robin / kv_aware: {ratio:.2f}x")


def overhead(one: str, procs: list) -> None:
    print("\n== (b) gateway overhead: one replica, direct vs through a gateway")
    gw_url, p = spawn("gateway", "--backend", one)
    procs.append(p)
    wait_ready(gw_url, 1)
    for conc, n, out_len in ((1, 12, 16), (8, 24, 48)):
        results: dict[str, list[dict]] = {"direct": [], "gateway": []}
        for rnd in range(3):
            for name, url in (("direct", one), ("gateway", gw_url)):
                # Fresh prompts every run: a repeat would hit the replica's prefix cache.
                seed = 100 * conc + 2 * rnd + (name == "gateway")
                cfg = ServeBenchConfig(
                    base_url=url,
                    num_requests=n,
                    max_concurrency=conc,
                    input_len=32,
                    output_len=out_len,
                    seed=seed,
                )
                results[name].append(run_serve_bench(cfg))
        report_overhead(conc, results)


if __name__ == "__main__":
    main()
