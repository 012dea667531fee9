"""Seed 003 exercise 1 on this machine, in one run: the same workload on TP=1 (one process, all
cores), TP=2 (one thread per rank) and PP=2 (one thread per stage), each a real `shoal serve`;
output tok/s, TTFT and ITL p50/p99, and where the ranks' step time goes (their own profile,
scraped from /metrics: time in all-reduce/all-gather, and a later stage's wait for the previous
one). Then the cost of one all-reduce, shared memory against gloo, measured by two processes.

    python benchmarks/parallel_scaling.py [--modes none,int4] [--levels 1,8] [--output-len 64]
        [--configs tp1,tp2,pp2]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from llama_cpp_server import wait_until_ok  # this script's folder is on sys.path

from shoal.bench.serve import ServeBenchConfig, run_serve_bench
from shoal.engine.parallel.comm import ShmCommunicator
from shoal.fleet.control.launchers.local import free_port
from shoal.kernels.build import cpu_model_name

CORES = os.cpu_count() or 1
CONFIGS = {
    "tp1": (f"TP=1 ({CORES} threads)", ["--threads", str(CORES)]),
    "tp2": ("TP=2 (1 thread/rank)", ["-tp", "2", "--threads", "1"]),
    "pp2": ("PP=2 (1 thread/stage)", ["-pp", "2", "--threads", "1"]),
    "tp3": ("TP=3 (1 thread/rank)", ["-tp", "3", "--threads", "1"]),
}
RANK_METRIC = re.compile(r'^(shoal:parallel_rank_\w+)\{model_name="[^"]*",rank="(\d+)"\} ([0-9.e+-]+)$')


def rank_profile(url: str) -> dict[tuple[str, int], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = RANK_METRIC.match(line)
        if m:
            name = m.group(1).removeprefix("shoal:parallel_rank_").removesuffix("_total")
            out[(name, int(m.group(2)))] = float(m.group(3))
    return out


def shares(before: dict, after: dict) -> tuple[float | None, float | None, float | None]:
    """(share of the ranks' step time in collectives, share waiting for the previous stage, mean
    time of one rank's step in seconds)."""
    ranks = {r for _, r in after}

    def delta(name: str) -> float:
        return sum(after[(name, r)] - before.get((name, r), 0) for r in ranks)

    step, steps = (delta("step_seconds"), delta("steps")) if ranks else (0, 0)
    if step <= 0:
        return None, None, None
    return delta("comm_seconds") / step, delta("stage_wait_seconds") / step, step / steps


def run_config(mode: str, args: list[str], levels: list[int], output_len: int) -> dict[int, dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--port", str(port), "-q", mode, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ok(url + "/ready", proc, "shoal serve", timeout=300)
        run_serve_bench(ServeBenchConfig(base_url=url, num_requests=2, input_len=32, output_len=8))  # warm
        out = {}
        for conc in levels:
            before = rank_profile(url)
            cfg = ServeBenchConfig(
                base_url=url,
                num_requests=max(4, 4 * conc),
                max_concurrency=conc,
                input_len=128,
                output_len=output_len,
            )
            res = run_serve_bench(cfg)
            res["comm_share"], res["wait_share"], res["rank_step_s"] = shares(before, rank_profile(url))
            out[conc] = res
        return out
    finally:
        proc.terminate()
        proc.wait(30)


# --- the all-reduce alone ---------------------------------------------------------------


def _allreduce_worker(rank: int, port: int, rows_list: list[int], iters: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    shm = ShmCommunicator(dist.group.WORLD, 2, rank, f"shoal-bench-{port}", 30.0)
    for rows in rows_list:
        t = torch.randn(rows, 576)
        for name, fn in (("shm", shm.all_reduce), ("gloo", lambda x: dist.all_reduce(x))):
            for _ in range(20):
                fn(t)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn(t)
            if rank == 0:
                results[(name, rows)] = (time.perf_counter() - t0) / iters
    shm.close()
    dist.destroy_process_group()


def allreduce_costs(rows_list: list[int], iters: int = 2000) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_allreduce_worker, args=(free_port(), rows_list, iters, results), nprocs=2)
        return dict(results)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="none,int4")
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--configs", default="tp1,tp2,pp2")
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    workload = f"128-token prompts, {args.output_len} output tokens"
    print(f"CPU: {cpu_model_name()}, {CORES} cores; workload: {workload}")
    costs = allreduce_costs([1, 8, 128])
    print("\nall-reduce of [rows, 576] fp32 between 2 processes (mean of 2000):")
    for rows in (1, 8, 128):
        s, g = costs[("shm", rows)], costs[("gloo", rows)]
        print(f"  rows {rows:>3}: shared memory {s * 1e6:7.1f} us, gloo {g * 1e6:7.1f} us ({g / s:.0f}x)")

    for mode in args.modes.split(","):
        results = {}
        for key in args.configs.split(","):
            label, flags = CONFIGS[key]
            print(f"\n-- {mode}: {label}", flush=True)
            results[key] = run_config(mode, flags, levels, args.output_len)
        base = results.get("tp1")
        print(f"\n== weights {mode} ==")
        print(
            f"{'config':<22} {'c':>3} {'out tok/s':>9} {'vs TP=1':>7} {'TTFT p50':>9} {'p99':>7} "
            f"{'ITL p50':>8} {'p99':>7} {'comm %':>7} {'wait %':>7} {'rank step':>9}"
        )
        for key, per_level in results.items():
            for conc, r in per_level.items():
                ratio = r["output_token_throughput"] / base[conc]["output_token_throughput"] if base else None
                comm, wait, rank_step = r["comm_share"], r["wait_share"], r["rank_step_s"]
                print(
                    f"{CONFIGS[key][0]:<22} {conc:>3} {r['output_token_throughput']:9.1f} "
                    f"{ratio if ratio is not None else float('nan'):7.2f} "
                    f"{1000 * r['ttft_s']['p50']:8.1f}ms {1000 * r['ttft_s']['p99']:6.1f} "
                    f"{1000 * r['itl_s']['p50']:7.1f}ms {1000 * r['itl_s']['p99']:6.1f} "
                    f"{'' if comm is None else f'{100 * comm:6.1f}%':>7} "
                    f"{'' if wait is None else f'{100 * wait:6.1f}%':>7} "
                    f"{'' if rank_step is None else f'{1000 * rank_step:7.1f}ms':>9}"
                )


if __name__ == "__main__":
    main()
