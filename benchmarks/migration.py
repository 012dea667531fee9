"""Live migration of a stream (issue 29): the pause its client sees when the stream moves to the
other replica mid-generation (`POST /fleet/migrate`; its context fetched from the replica it
leaves), by context length, against a decode step (the median gap between tokens) and against
computing the context (the time to first token of the same prompt, uncached).

Two replicas of the bundled model (int4) behind `shoal fleet up`, requests alternating between
them; one stream at a time, 64 greedy tokens, moved after 16.

Then a skewed load on two replicas (8 sequences each at most): requests arrive at random (Poisson,
--rate a second, for --duration seconds), 128-token prompts, 128 tokens out; 80% of them belong
to one session, which the gateway's session policy pins to one replica, the rest to sessions of
their own. TTFT p50/p99 and the replicas' preemptions, without and with the gateway's
rebalancing (`--rebalance`: running streams move off a replica whose engine has a queue).

    python benchmarks/migration.py [--lengths 256,1000,2000] [--rate 1.6] [--duration 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from itertools import pairwise
from pathlib import Path

import httpx
from kv_tiers import metric, two_replicas  # this script's folder is on sys.path

from shoal.bench.workload import exact_length_text
from shoal.models.checkpoint import load_tokenizer

MODEL = "SmolLM2-135M-Instruct"


def stream(url: str, prompt: str, move_after: int | None) -> list[float]:
    """Arrival times of the stream's tokens (moved after `move_after` events, if given)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    times, events = [], 0
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        r.raise_for_status()
        replica = r.headers["x-replica"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
                events += 1
                if events == move_after:
                    moved = httpx.post(url + "/fleet/migrate", json={"replica": replica}, timeout=30)
                    assert moved.json()["moved"] == 1, moved.text
    return times


async def timed_stream(c: httpx.AsyncClient, url: str, prompt: str, session: str, at: float) -> float:
    """TTFT (s) of one streamed request sent at `at` (perf_counter time)."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 128, "temperature": 0, "ignore_eos": True}
    sent = time.perf_counter()
    headers = {"x-session-id": session}
    async with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        r.raise_for_status()
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                first = time.perf_counter() - sent
    return first


async def skewed_load(url: str, rate: float, duration: float) -> list[float]:
    tok = load_tokenizer(None)
    rng = random.Random(1)
    start = time.perf_counter() + 0.5
    at, jobs = 0.0, []
    async with httpx.AsyncClient(timeout=600) as c:
        while (at := at + rng.expovariate(rate)) < duration:
            session = "the-busy-session" if rng.random() < 0.8 else f"session-{len(jobs)}"
            jobs.append(timed_stream(c, url, exact_length_text(tok, 128, rng), session, start + at))
        return await asyncio.gather(*jobs)


def skew_rows(rate: float, duration: float) -> list[tuple]:
    rows = []
    for rebalance in (False, True):
        more = ("--rebalance",) if rebalance else ()
        with two_replicas("1GiB", True, Path("/tmp"), "session", more, seqs=8) as url:
            reps = [r["url"] for r in httpx.get(url + "/replicas").json()["replicas"]]
            ttfts = sorted(asyncio.run(skewed_load(url, rate, duration)))
            preempted = sum(metric(r, "shoal:num_preemptions_total") for r in reps)
            moved = metric(url, 'shoal:gateway_migrations_total{outcome="ok"')
            p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
            rows.append((rebalance, len(ttfts), statistics.median(ttfts), p99, preempted, moved))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,1000,2000")
    ap.add_argument("--rate", type=float, default=1.6, help="requests a second in the skewed load")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals in the skewed load")
    ap.add_argument("--skew-only", action="store_true")
    args = ap.parse_args()
    if not args.skew_only:
        pauses(args.lengths)
    rows = skew_rows(args.rate, args.duration)
    print(f"\n| skewed load, {args.rate}/s for {args.duration:.0f} s | requests | TTFT p50 ms | TTFT p99 ms "
          "| preemptions | streams moved |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for rebalance, n, p50, p99, preempted, moved in rows:
        name = "with rebalancing" if rebalance else "without"
        print(f"| {name} | {n} | {1000 * p50:.0f} | {1000 * p99:.0f} | {preempted:.0f} | {moved:.0f} |")
    print(f"TTFT p99 without / with rebalancing: {rows[0][3] / rows[1][3]:.2f}x")


def pauses(lengths: str) -> None:
    tok = load_tokenizer(None)
    rng = random.Random(0)
    rows = []
    with two_replicas("1GiB", True, Path("/tmp")) as url:
        for n in (int(x) for x in lengths.split(",")):
            prompts = [exact_length_text(tok, n, rng) for _ in range(3)]
            t0 = time.perf_counter()
            cold = stream(url, prompts[0], None)  # computed from scratch: its TTFT is the prompt's
            compute = cold[0] - t0
            times = stream(url, prompts[1], 16)
            gaps = [b - a for a, b in pairwise(times)]
            pause = gaps[15]  # from the 16th token, just before the move, to the 17th
            step = statistics.median(gaps[:14] + gaps[17:])
            rows.append((n, pause, step, compute))
    print("\n| context tokens | pause ms | decode step ms | pause / step | compute the context ms |")
    print("| --- | --- | --- | --- | --- |")
    for n, pause, step, compute in rows:
        print(f"| {n} | {1000 * pause:.0f} | {1000 * step:.1f} | {pause / step:.1f} | {1000 * compute:.0f} |")


if __name__ == "__main__":
    main()
