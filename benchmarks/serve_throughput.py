"""Every quantization mode of `shoal serve` at concurrency 1, 8 and 32 (W1: 32-token prompts, 128
greedy output tokens, EOS ignored, streamed), one system at a time in one run, with llama.cpp's
`llama-server` on the same GGUF beside them (--llama-cpp; built once, see benchmarks/llama_cpp_server.py).
Prints the CPU, its flags, the kernel crossovers measured on it, and one table.

    python benchmarks/serve_throughput.py [--modes auto,none,int8,int4] [--llama-cpp] [--compare-hf]
        [--offline]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time

import torch
from llama_cpp_server import wait_until_ok  # this script's folder is on sys.path

from shoal.bench.offline import OfflineBenchConfig, make_workload, run_hf, run_offline_bench
from shoal.bench.serve import ServeBenchConfig, run_serve_bench
from shoal.kernels.build import compile_flags, cpu_flags, cpu_model_name
from shoal.kernels.cpu import cpu_kernels
from shoal.models.checkpoint import bundled_model_path
from shoal.models.gguf_cache import load_cached
from shoal.models.quant import resolve_quantization

LEVELS = [(1, 8), (8, 32), (32, 64)]  # (concurrency, requests)
VOCAB = 49152  # the bundled model's; prompts are random ids below it
SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")


@contextlib.contextmanager
def shoal_server(port: int, mode: str, env: dict | None = None, extra: tuple[str, ...] = ()):
    """`shoal serve` of the bundled model, with `extra` flags; `env` replaces the environment
    (another checkout's PYTHONPATH, say)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--port", str(port), "--quantization", mode, *extra]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ok(url + "/ready", proc, "shoal serve", timeout=300)
        print(f"   ready in {time.perf_counter() - t0:.1f} s")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def run_levels(url: str, model: str | None = None) -> dict[int, dict]:
    out = {}
    for conc, n in LEVELS:
        cfg = ServeBenchConfig(
            base_url=url, model=model, num_requests=n, max_concurrency=conc, input_len=32, output_len=128
        )
        out[conc] = run_serve_bench(cfg)
    return out


def describe_cpu() -> str:
    flags = cpu_flags()
    shown = " ".join(f for f in SHOWN_FLAGS if f in flags)
    isa = "VNNI" if "-mavx512vnni" in compile_flags() else "AVX2"
    return f"{cpu_model_name()}, {os.cpu_count()} cores; flags: {shown}; kernels built for {isa}"


def auto_means() -> str:
    cached = load_cached(bundled_model_path(), torch.float32)
    if cached is None:
        return "(not converted yet)"
    return resolve_quantization("auto", cached.block_formats()) or "none"


def print_ratios(results: dict[str, dict[int, dict]], base: dict[int, dict], label: str) -> None:
    for name, r in results.items():
        ratios = " / ".join(
            f"{r[c]['output_token_throughput'] / base[c]['output_token_throughput']:.2f}" for c, _ in LEVELS
        )
        print(f"{name} / {label} at c=1 / 8 / 32: {ratios}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--modes", default="none,int8,int4", help="comma-separated --quantization values")
    ap.add_argument("--llama-cpp", action="store_true", help="also llama.cpp's llama-server, 32 slots")
    ap.add_argument("--compare-hf", action="store_true", help="also HF static batches of 1, 8 and 32")
    ap.add_argument(
        "--offline", action="store_true", help="also `shoal bench offline` at c=32 (default mode)"
    )
    args = ap.parse_args()
    print(f"CPU: {describe_cpu()}")
    kernels = cpu_kernels()
    if kernels is not None:
        print(f"kernel crossovers: {kernels.choices.summary()}")
    results: dict[str, dict[int, dict]] = {}
    if args.llama_cpp:
        from llama_cpp_server import VERSION, serve

        print(f"== llama.cpp llama-server (llama-cpp-python {VERSION}), Q4_1 as stored, 32 slots")
        with serve(args.port + 1) as url:
            results["llama.cpp Q4_1"] = run_levels(url)
    for mode in args.modes.split(","):
        print(f"== shoal serve --quantization {mode}")
        with shoal_server(args.port, mode) as url:
            results[f"shoal {mode}"] = run_levels(url)
    print(f"\n`auto` on the bundled model means: {auto_means()}")
    print("\n| system | c=1 tok/s | c=8 | c=32 | TTFT p50 c=1 | TTFT p50 c=32 | TPOT p50 c=32 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        t = {c: r[c]["output_token_throughput"] for c in r}
        print(
            f"| {name} | {t[1]:.0f} | {t[8]:.0f} | {t[32]:.0f} | {r[1]['ttft_s']['p50'] * 1000:.0f} ms | "
            f"{r[32]['ttft_s']['p50'] * 1000:.0f} ms | {r[32]['tpot_s']['p50'] * 1000:.1f} ms |"
        )
    for base, label in (("shoal none", "shoal fp32"), ("llama.cpp Q4_1", "llama.cpp")):
        if base in results:
            print_ratios(results, results[base], label)
    if args.offline:
        off = run_offline_bench(OfflineBenchConfig(num_requests=64, input_len=32, output_len=128), None,
                                {"max_num_seqs": 32})["shoal"]  # fmt: skip
        print(f"offline (max_num_seqs 32, default mode): {off['output_tok_s']:.1f} output tok/s")
    if args.compare_hf:
        for conc, n in LEVELS:
            work = make_workload(OfflineBenchConfig(num_requests=n, input_len=32, output_len=128), VOCAB)
            tok_s = run_hf(None, work, conc)["output_tok_s"]
            print(f"HF transformers fp32, static batches of {conc}: {tok_s:.0f} tok/s")


if __name__ == "__main__":
    main()
