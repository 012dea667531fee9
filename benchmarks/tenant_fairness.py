"""Fair sharing between tenants under saturation (issue 18): two tenants of equal weight, each
limited to --headroom times its share of the fleet's measured capacity (requests per minute).
The quiet tenant sends at --quiet-share of its share, the flooder at --flood-factor times it. Prints the
quiet tenant's TTFT alone and beside the flood, with the gateway's fair queue and with first come
first served, and what the flooder saw (429s, its own TTFT and gateway queue time).

    python benchmarks/tenant_fairness.py [--duration 40] [--flood-factor 5] [--quiet-share 0.5]
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
from autoscale import MODEL, pct  # this script's folder is on sys.path
from fleet_process import FleetProcess, metric

from shoal.fleet.admission.tenants import key_digest
from shoal.kernels.build import cpu_model_name

REPLICA_ARGS = "--threads 2 --kv-cache-memory 512MiB"
KEYS = {"quiet": "sk-quiet", "flood": "sk-flood"}
SLOTS = 4  # requests a replica runs at once; more wait in the gateway's queue, in its order


def config(path: str, state: str, rpm: float, fair: bool) -> None:
    tenants = "".join(
        f'[[tenants]]\nname = "{n}"\napi_key_sha256 = "{key_digest(k)}"\nrequests_per_minute = {rpm:.0f}\n\n'
        for n, k in KEYS.items()
    )
    with open(path, "w") as f:
        f.write(
            f'[gateway]\nstate_dir = "{state}"\nmax_inflight_per_replica = {SLOTS}\n'
            f"queue_timeout_s = 120\nfair_queuing = {str(fair).lower()}\n\n{tenants}"
        )


async def one(client, url: str, tenant: str, at: float, t0: float, rng: random.Random, out_len: int):
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    body = {
        "model": MODEL,
        "prompt": [rng.randrange(1000, 40000) for _ in range(64)],
        "max_tokens": out_len,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return {"tenant": tenant, "status": r.status_code, "ttft": None}
            ttft = None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - start
            return {"tenant": tenant, "status": 200, "ttft": ttft}
    except httpx.HTTPError:
        return {"tenant": tenant, "status": 0, "ttft": None}


def arrivals(rate: float, duration: float, rng: random.Random) -> list[float]:
    times, t = [], 0.0
    while rate > 0 and (t := t + rng.expovariate(rate)) < duration:
        times.append(t)
    return times


async def play(url: str, rates: dict[str, float], duration: float, out_len: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    jobs = [(tenant, at) for tenant, rate in rates.items() for at in arrivals(rate, duration, rng)]
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*(one(client, url, t, at, t0, rng, out_len) for t, at in jobs))


async def capacity(url: str, out_len: int, n: int = 24) -> float:
    """Requests per second the fleet finishes with its slots full."""
    rng = random.Random(99)
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, url, "quiet", 0.0, t0, rng, out_len) for _ in range(n)))
        return n / (time.perf_counter() - t0)


def stats(results: list[dict], tenant: str) -> dict:
    mine = [r for r in results if r["tenant"] == tenant]
    ttfts = [r["ttft"] for r in mine if r["ttft"] is not None]
    return {
        "sent": len(mine),
        "ok": len(ttfts),
        "rate_limited": sum(r["status"] == 429 for r in mine),
        "failed": sum(r["status"] not in (200, 429) for r in mine),
        "ttft_p50": pct(ttfts, 50),
        "ttft_p99": pct(ttfts, 99),
    }


def run_fleet(a, fair: bool, rpm: float | None) -> dict:
    state = tempfile.mkdtemp(prefix="shoal-bench-fair-")
    path = os.path.join(state, "fleet.toml")
    config(path, state, rpm or 1e6, fair)
    fleet = FleetProcess(["--config", path, "--replicas", "1"], REPLICA_ARGS)
    try:
        fleet.wait_ready(1)
        asyncio.run(play(fleet.url, {"quiet": 4.0}, 1.0, a.output_len, 0))  # warm-up
        out: dict = {}
        if rpm is None:
            out["capacity"] = asyncio.run(capacity(fleet.url, a.output_len))
            return out
        share = rpm / 60 / a.headroom
        alone = asyncio.run(play(fleet.url, {"quiet": a.quiet_share * share}, a.duration, a.output_len, 1))
        out["alone"] = stats(alone, "quiet")
        rates = {"quiet": a.quiet_share * share, "flood": a.flood_factor * share}
        mixed = asyncio.run(play(fleet.url, rates, a.duration, a.output_len, 1))
        out["quiet"], out["flood"] = stats(mixed, "quiet"), stats(mixed, "flood")
        for t in KEYS:
            n = metric(fleet.url, f'shoal:gateway_tenant_queue_seconds_count{{tenant="{t}"}}')
            s = metric(fleet.url, f'shoal:gateway_tenant_queue_seconds_sum{{tenant="{t}"}}')
            out[t]["mean_queue_s"] = s / n if n else 0.0
        return out
    finally:
        fleet.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=40.0, help="seconds of load per phase")
    p.add_argument("--flood-factor", type=float, default=5.0, help="the flooder's rate, in shares")
    p.add_argument("--quiet-share", type=float, default=0.5, help="the quiet tenant's rate, in shares")
    p.add_argument("--headroom", type=float, default=2.0, help="each tenant's limit, in shares")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    cap = run_fleet(a, True, None)["capacity"]
    share = cap / 2  # two tenants of equal weight
    rpm = share * 60 * a.headroom
    print(
        f"CPU: {cpu_model_name()}, {os.cpu_count()} cores; 1 replica ({REPLICA_ARGS}), {SLOTS} slots; "
        f"capacity {cap:.2f} req/s (64-token prompts, {a.output_len} tokens out), a share {share:.2f} "
        f"req/s; each tenant limited to {rpm:.0f} req/min; quiet at {a.quiet_share:g} shares, flood at "
        f"{a.flood_factor:g}; {a.duration:.0f} s per phase",
        flush=True,
    )
    report = {"capacity": cap, "rpm": rpm}
    print("| queue | tenant | sent | 429 | failed | TTFT p50 | TTFT p99 | vs alone p99 | queue mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fair in (True, False):
        r = run_fleet(a, fair, rpm)
        name = "fair (VTC)" if fair else "first come"
        report[name] = r
        base = r["alone"]["ttft_p99"]
        rows = [("quiet alone", r["alone"]), ("quiet", r["quiet"]), ("flood", r["flood"])]
        for label, s in rows:
            q = f"{1000 * s['mean_queue_s']:.0f} ms" if "mean_queue_s" in s else "-"
            print(
                f"| {name} | {label} | {s['sent']} | {s['rate_limited']} | {s['failed']} | "
                f"{1000 * s['ttft_p50']:.0f} ms | {1000 * s['ttft_p99']:.0f} ms | "
                f"{s['ttft_p99'] / base:.2f}x | {q} |",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
