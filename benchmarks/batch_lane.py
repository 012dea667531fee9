"""The batch lane: what it costs interactive traffic, and whether it survives a crash.

(1) Interactive TTFT p50/p99 under a steady Poisson load alone, then the same load (same seed)
    while a batch of --lines requests runs: the ratio (goal: p99 within 1.2x), the batch's
    completion time and lines/s.
(2) kill -9 of the fleet process mid-batch, a new one on the same state directory: the batch
    completes with exactly --lines results, one per custom_id.

    python benchmarks/batch_lane.py [--lines 500] [--duration 60] [--rate 1] [--replicas 1]
        [--batch-max-inflight 4] [--output-len 32] [--batch-output-len 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time

import httpx
from autoscale import MODEL, one, pct  # this script's folder is on sys.path
from fleet_process import FleetProcess

from shoal.kernels.build import cpu_model_name

REPLICA_ARGS = "--threads 1 --kv-cache-memory 512MiB"
DONE = ("completed", "failed", "expired", "cancelled")


def arrivals(rate: float, duration: float, seed: int) -> list[float]:
    rng, times, t = random.Random(seed), [], 0.0
    while (t := t + rng.expovariate(rate)) < duration:
        times.append(t)
    return times


def batch_input(n: int, out_len: int, seed: int) -> bytes:
    rng = random.Random(seed)
    rows = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": MODEL,
                "prompt": [rng.randrange(1000, 40000) for _ in range(48)],
                "max_tokens": out_len,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def start_batch(url: str, content: bytes) -> str:
    f = httpx.post(
        url + "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, timeout=60
    )
    f.raise_for_status()
    body = {"input_file_id": f.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    b = httpx.post(url + "/v1/batches", json=body, timeout=60)
    b.raise_for_status()
    assert b.json()["status"] == "in_progress", b.json()
    return b.json()["id"]


def batch(url: str, batch_id: str) -> dict:
    return httpx.get(f"{url}/v1/batches/{batch_id}", timeout=10).json()


def wait_done(url: str, batch_id: str, timeout: float = 3600) -> dict:
    deadline = time.monotonic() + timeout
    while (b := batch(url, batch_id))["status"] not in DONE:
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch not done: {b}")
        time.sleep(0.5)
    return b


def result_ids(url: str, b: dict) -> list[str]:
    ids = []
    for key in ("output_file_id", "error_file_id"):
        if b[key]:
            text = httpx.get(f"{url}/v1/files/{b[key]}/content", timeout=60).text
            ids += [json.loads(line)["custom_id"] for line in text.splitlines()]
    return ids


async def load(url: str, times: list[float], a: argparse.Namespace) -> list[dict]:
    rng = random.Random(a.seed + 1)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*(one(client, url, at, t0, rng, a.output_len) for at in times))


def summary(label: str, results: list[dict]) -> dict:
    ttfts = [r["ttft"] for r in results if r["ok"]]
    return {
        "label": label,
        "requests": len(results),
        "failed": sum(not r["ok"] for r in results),
        "ttft_p50": pct(ttfts, 50),
        "ttft_p99": pct(ttfts, 99),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=500)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of interactive load per phase")
    p.add_argument("--rate", type=float, default=1.0, help="interactive requests per second")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--batch-max-inflight", type=int, default=4)
    p.add_argument("--output-len", type=int, default=32, help="interactive completion tokens")
    p.add_argument("--batch-output-len", type=int, default=16)
    p.add_argument("--kill-at", type=float, default=0.3, help="share of the batch done at the kill -9")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    state = tempfile.mkdtemp(prefix="shoal-bench-batch-")
    config = os.path.join(state, "fleet.toml")
    with open(config, "w") as f:
        f.write(f'[gateway]\nstate_dir = "{state}"\nbatch_max_inflight = {a.batch_max_inflight}\n')
    args = ["--config", config, "--replicas", str(a.replicas)]
    times = arrivals(a.rate, a.duration, a.seed)
    print(
        f"CPU: {cpu_model_name()}, {os.cpu_count()} cores; {a.replicas} replicas ({REPLICA_ARGS}); "
        f"{len(times)} interactive requests over {a.duration:.0f} s per phase; batch of {a.lines} "
        f"({a.batch_output_len} tokens each, at most {a.batch_max_inflight} in flight)",
        flush=True,
    )
    fleet = FleetProcess(args, REPLICA_ARGS)
    out: dict = {}
    try:
        fleet.wait_ready(a.replicas)
        asyncio.run(load(fleet.url, [0.0, 0.1, 0.2], a))  # warm-up
        alone = summary("interactive alone", asyncio.run(load(fleet.url, times, a)))
        started = time.perf_counter()
        batch_id = start_batch(fleet.url, batch_input(a.lines, a.batch_output_len, a.seed))
        mixed = summary("with the batch running", asyncio.run(load(fleet.url, times, a)))
        load_end = time.perf_counter() - started
        b = wait_done(fleet.url, batch_id)
        took = time.perf_counter() - started
        counts = b["request_counts"]
        out.update(alone=alone, mixed=mixed, batch_s=took, batch_status=b["status"], counts=counts)
        print("| phase | requests | failed | TTFT p50 | TTFT p99 |\n|---|---|---|---|---|")
        for s in (alone, mixed):
            print(
                f"| {s['label']} | {s['requests']} | {s['failed']} | {1000 * s['ttft_p50']:.0f} ms "
                f"| {1000 * s['ttft_p99']:.0f} ms |"
            )
        overlap = min(1.0, took / load_end) if load_end else 1.0
        print(
            f"TTFT p99 with the batch: {mixed['ttft_p99'] / alone['ttft_p99']:.2f}x alone (goal <= 1.2x); "
            f"p50 {mixed['ttft_p50'] / alone['ttft_p50']:.2f}x. The batch ran {100 * overlap:.0f} % of "
            f"the loaded phase"
        )
        print(
            f"batch: {b['status']} in {took:.1f} s, {counts['completed']} done, {counts['failed']} failed, "
            f"{a.lines / took:.2f} lines/s",
            flush=True,
        )

        # (2) kill -9 mid-batch, then a new fleet on the same state directory.
        batch_id = start_batch(fleet.url, batch_input(a.lines, a.batch_output_len, a.seed + 2))
        while (done := batch(fleet.url, batch_id)["request_counts"]["completed"]) < max(
            1, a.kill_at * a.lines
        ):
            time.sleep(0.05)
        fleet.proc.kill()
        fleet.proc.wait()
        fleet = FleetProcess(args, REPLICA_ARGS)
        fleet.wait_ready(a.replicas)
        b = wait_done(fleet.url, batch_id)
        ids = result_ids(fleet.url, b)
        ok = b["status"] == "completed" and len(ids) == len(set(ids)) == a.lines
        out["kill"] = {"done_at_kill": done, "results": len(ids), "distinct": len(set(ids)), "ok": ok}
        print(
            f"kill -9 at {done}/{a.lines} done; after the restart: {b['status']}, {len(ids)} result lines, "
            f"{len(set(ids))} distinct custom_ids (goal: exactly {a.lines}): {'OK' if ok else 'FAILED'}"
        )
    finally:
        fleet.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
