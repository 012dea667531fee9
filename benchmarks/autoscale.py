"""Autoscaling against a fleet sized for the peak, on one bursty trace (issue 17): Poisson arrivals
whose rate jumps for a while and falls back, played against (a) a fixed fleet of --max replicas
and (b) the same fleet autoscaled between --min and --max. Prints, for each, replica-seconds used
(every loaded replica process counts, standbys included), TTFT p50/p99 and failed requests, the
cold start and warm promotion times the gateway measured, and writes a plot of replicas, queue
depth and TTFT over time.

    python benchmarks/autoscale.py [--min 1] [--max 2] [--quiet-rate 0.5] [--burst-rate 4]
        [--quiet 60] [--burst 30] [--cycles 2] [--plot autoscale.png]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import time

import httpx
from fleet_process import FleetProcess  # this script's folder is on sys.path

from shoal.kernels.build import cpu_model_name

MODEL = "SmolLM2-135M-Instruct"
REPLICA_ARGS = "--threads 1 --kv-cache-memory 512MiB"


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] if s else float("nan")


def trace(a: argparse.Namespace) -> list[float]:
    """Arrival times: quiet, burst, quiet, burst, ..., quiet."""
    rng = random.Random(a.seed)
    times, t = [], 0.0
    phases = [(a.quiet, a.quiet_rate), *[(a.burst, a.burst_rate), (a.quiet, a.quiet_rate)] * a.cycles]
    start = 0.0
    for length, rate in phases:
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + length:
                break
            times.append(t)
        start += length
    return times


async def one(
    client: httpx.AsyncClient, url: str, at: float, t0: float, rng: random.Random, out: int
) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    body = {
        "model": MODEL,
        "prompt": [rng.randrange(1000, 40000) for _ in range(48)],
        "max_tokens": out,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    sent = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"at": at, "ok": False}
            first = None
            async for line in r.aiter_lines():
                if line.startswith("data: {") and first is None and "error" not in line:
                    first = time.perf_counter()
                elif '"error"' in line:
                    return {"at": at, "ok": False}
    except httpx.HTTPError:
        return {"at": at, "ok": False}
    return {"at": at, "ok": first is not None, "ttft": (first or sent) - sent}


async def replay(
    fleet: FleetProcess, arrivals: list[float], a: argparse.Namespace
) -> tuple[list[dict], list[dict]]:
    """Plays the trace; samples the fleet's processes every 0.5 s meanwhile."""
    samples: list[dict] = []
    rng = random.Random(a.seed + 1)
    t0 = time.perf_counter()
    end = t0 + (arrivals[-1] if arrivals else 0) + 5

    async def sample():
        async with httpx.AsyncClient(timeout=5) as c:
            while time.perf_counter() < end:
                try:
                    reps = (await c.get(fleet.url + "/replicas")).json()["replicas"]
                    loaded = sum(r["pid"] is not None and r["state"] != "down" for r in reps)
                    samples.append({"t": time.perf_counter() - t0, "replicas": loaded})
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                await asyncio.sleep(0.5)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=500)) as client:
        sampler = asyncio.create_task(sample())
        results = await asyncio.gather(
            *(one(client, fleet.url, at, t0, rng, a.output_len) for at in arrivals)
        )
        await sampler
    return results, samples


def replica_seconds(samples: list[dict]) -> float:
    return sum((b["t"] - a["t"]) * a["replicas"] for a, b in itertools.pairwise(samples))


def gateway_histogram(url: str, name: str, label: str) -> tuple[float, float]:
    """(count, sum) of one labelled histogram on the gateway's /metrics."""
    count = total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "_count{") and label in line:
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_sum{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return count, total


def run(label: str, args: list[str], ready: int, arrivals: list[float], a: argparse.Namespace) -> dict:
    fleet = FleetProcess(args, REPLICA_ARGS)
    try:
        fleet.wait_ready(ready)
        results, samples = asyncio.run(replay(fleet, arrivals, a))
        history = httpx.get(fleet.url + "/fleet/state", timeout=10).json()["history"]
        cold = gateway_histogram(fleet.url, "shoal:gateway_replica_start_seconds", 'kind="cold"')
        warm = gateway_histogram(fleet.url, "shoal:gateway_replica_start_seconds", 'kind="warm"')
    finally:
        fleet.stop()
    ttfts = [r["ttft"] for r in results if r["ok"]]
    return {
        "label": label,
        "replica_s": replica_seconds(samples),
        "ttft_p50": pct(ttfts, 50),
        "ttft_p99": pct(ttfts, 99),
        "failed": sum(not r["ok"] for r in results),
        "requests": len(results),
        "cold_start_s": cold[1] / cold[0] if cold[0] else None,
        "warm_promotion_s": warm[1] / warm[0] if warm[0] else None,
        "samples": samples,
        "history": history,
        "results": results,
    }


def plot(runs: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: pip install 'shoal[plot]' for the plot)")
        return
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for r in runs:
        axes[0].plot([s["t"] for s in r["samples"]], [s["replicas"] for s in r["samples"]], label=r["label"])
        h = r["history"]
        if h:
            t0 = h[0]["time"]
            queued = [sum(p["queued"] + p["waiting"] for p in s["pools"].values()) for s in h]
            axes[1].plot([s["time"] - t0 for s in h], queued, label=r["label"])
        ok = [x for x in r["results"] if x["ok"]]
        axes[2].scatter([x["at"] for x in ok], [x["ttft"] for x in ok], s=6, label=r["label"])
    axes[0].set_ylabel("replicas loaded")
    axes[1].set_ylabel("requests queued")
    axes[2].set_ylabel("TTFT (s)")
    axes[2].set_xlabel("seconds into the trace")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, default=2)
    p.add_argument("--warm-standby", type=int, default=0)
    p.add_argument("--quiet-rate", type=float, default=0.5)
    p.add_argument("--burst-rate", type=float, default=4.0)
    p.add_argument("--quiet", type=float, default=60.0)
    p.add_argument("--burst", type=float, default=30.0)
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--target-inflight", type=float, default=4.0)
    p.add_argument("--scale-down-delay", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="autoscale.png")
    a = p.parse_args()
    arrivals = trace(a)
    print(
        f"CPU: {cpu_model_name()}, {os.cpu_count()} cores; replicas: {REPLICA_ARGS}; "
        f"{len(arrivals)} requests "
        f"({a.quiet_rate}/s for {a.quiet:.0f} s, {a.burst_rate}/s for {a.burst:.0f} s, x{a.cycles}), "
        f"48-token prompts, {a.output_len} tokens each"
    )
    auto = ["--min-replicas", str(a.min), "--max-replicas", str(a.max), "--warm-standby", str(a.warm_standby)]
    auto += ["--target-inflight", str(a.target_inflight), "--scale-up-delay", "0.5"]
    auto += ["--scale-down-delay", str(a.scale_down_delay)]
    runs = [
        run(f"(a) fixed, {a.max} replicas", ["--replicas", str(a.max)], a.max, arrivals, a),
        run(f"(b) autoscaled {a.min}-{a.max}", auto, max(a.min, 1), arrivals, a),
    ]
    print("| fleet | replica-seconds | TTFT p50 | TTFT p99 | failed | cold start | warm promotion |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        cold = f"{r['cold_start_s']:.1f} s" if r["cold_start_s"] else "-"
        warm = f"{1000 * r['warm_promotion_s']:.0f} ms" if r["warm_promotion_s"] else "-"
        cells = [
            r["label"],
            f"{r['replica_s']:.0f}",
            f"{1000 * r['ttft_p50']:.0f} ms",
            f"{1000 * r['ttft_p99']:.0f} ms",
        ]
        print("| " + " | ".join([*cells, f"{r['failed']}/{r['requests']}", cold, warm]) + " |")
    fixed, scaled = runs
    saved = 1 - scaled["replica_s"] / fixed["replica_s"]
    print(
        f"autoscaled uses {100 * saved:.0f} % fewer replica-seconds (goal >= 30 %), TTFT p99 "
        f"{scaled['ttft_p99'] / fixed['ttft_p99']:.2f}x the fixed fleet's (goal <= 1.5x)"
    )
    plot(runs, a.plot)
    with open(os.path.splitext(a.plot)[0] + ".json", "w") as f:
        json.dump(
            [{k: v for k, v in r.items() if k not in ("samples", "history", "results")} for r in runs], f
        )


if __name__ == "__main__":
    main()
