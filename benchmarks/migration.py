"""Live migration of a stream (issue 29): the pause its client sees when the stream moves to the
other replica mid-generation (`POST /fleet/migrate`; its context fetched from the replica it
leaves), by context length, against a decode step (the median gap between tokens) and against
computing the context (the time to first token of the same prompt, uncached).

Two replicas of the bundled model (int4) behind `shoal fleet up`, requests alternating between
them; one stream at a time, 64 greedy tokens, moved after 16.

    python benchmarks/migration.py [--lengths 256,1000,2000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from itertools import pairwise
from pathlib import Path

import httpx
from kv_tiers import two_replicas  # this script's folder is on sys.path

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,1000,2000")
    args = ap.parse_args()
    tok = load_tokenizer(None)
    rng = random.Random(0)
    rows = []
    with two_replicas("1GiB", True, Path("/tmp")) as url:
        for n in (int(x) for x in args.lengths.split(",")):
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
