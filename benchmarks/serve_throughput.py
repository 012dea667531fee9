"""`shoal bench serve` against a local `shoal serve` at concurrency 1, 8 and 32 (32-token prompts,
128 output tokens, EOS ignored), then `shoal bench offline` on the same workload with the engine
capped at 32 sequences: the ratio is what the HTTP API costs.

    python benchmarks/serve_throughput.py [--port 8123] [--compare-hf] [--quantization int8|int4]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import httpx

from shoal.bench.offline import OfflineBenchConfig, make_workload, run_hf, run_offline_bench
from shoal.bench.serve import ServeBenchConfig, run_serve_bench

LEVELS = [(1, 8), (8, 32), (32, 64)]  # (concurrency, requests)
VOCAB = 49152  # the bundled model's; prompts are random ids below it


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("shoal serve exited early")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("shoal serve did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--compare-hf", action="store_true", help="also HF static batches of 1, 8 and 32")
    ap.add_argument("--quantization", choices=["int8", "int4"], default=None)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    t0 = time.perf_counter()
    quant = ["--quantization", args.quantization] if args.quantization else []
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--port", str(args.port), *quant])
    rows = []
    try:
        wait_ready(url, proc)
        ready_s = time.perf_counter() - t0
        for conc, n in LEVELS:
            print(f"== serve, concurrency {conc}")
            s = run_serve_bench(
                ServeBenchConfig(
                    base_url=url, num_requests=n, max_concurrency=conc, input_len=32, output_len=128
                )
            )
            rows.append((conc, n, s))
    finally:
        proc.terminate()
        proc.wait(30)
    print("== offline, same workload as concurrency 32, engine capped at 32 sequences")
    off = run_offline_bench(
        OfflineBenchConfig(num_requests=64, input_len=32, output_len=128),
        None,
        {"max_num_seqs": 32, **({"quantization": args.quantization} if args.quantization else {})},
    )["shoal"]
    print("\n| concurrency | requests | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p99 ms | E2E p50 s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for conc, n, s in rows:
        print(
            f"| {conc} | {n} | {s['output_token_throughput']:.1f} | {1000 * s['ttft_s']['p50']:.0f} | "
            f"{1000 * s['tpot_s']['p50']:.1f} | {1000 * s['itl_s']['p99']:.0f} | {s['e2e_s']['p50']:.2f} |"
        )
    c32 = rows[-1][2]["output_token_throughput"]
    print(f"\noffline (max_num_seqs 32): {off['output_tok_s']:.1f} output tok/s")
    print(f"server at concurrency 32 / offline: {c32 / off['output_tok_s']:.3f}")
    print(f"shoal serve start to ready: {ready_s:.2f} s")
    if args.compare_hf:
        hf = {}
        for conc, n in LEVELS:
            print(f"== HF transformers, static batches of {conc}")
            work = make_workload(OfflineBenchConfig(num_requests=n, input_len=32, output_len=128), VOCAB)
            hf[conc] = run_hf(None, work, conc)["output_tok_s"]
        print("\n| system | c=1 | c=8 | c=32 | TTFT p50 at c=32 | start to ready |")
        print("| --- | --- | --- | --- | --- | --- |")
        print(f"| HF transformers fp32, static batches | {hf[1]:.0f} | {hf[8]:.0f} | {hf[32]:.0f} | - | - |")
        tput = {conc: s["output_token_throughput"] for conc, _, s in rows}
        print(
            f"| shoal serve {args.quantization or 'fp32'} | {tput[1]:.0f} | {tput[8]:.0f} | {tput[32]:.0f} | "
            f"{rows[-1][2]['ttft_s']['p50']:.2f} s | {ready_s:.1f} s |"
        )
        print(f"shoal / HF at c=32: {tput[32] / hf[32]:.2f}x")


if __name__ == "__main__":
    main()
