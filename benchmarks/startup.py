"""Seconds from launching `shoal serve` to `/ready` answering 200: with an empty conversion cache
(the first start on a machine: GGUF conversion and kernel build) and with it filled (every start
after).

    python benchmarks/startup.py [--quantization auto|none|int8|int4]  (default: auto, as `shoal serve`)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import httpx

from shoal.fleet.control.launchers.local import free_port


def start_to_ready(env: dict, extra: list[str]) -> float:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "serve", "--port", str(port), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit("shoal serve exited")
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default=None)
    args = ap.parse_args()
    extra = ["--quantization", args.quantization] if args.quantization else []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "SHOAL_CACHE_DIR": cache}
        cold = start_to_ready(env, extra)
        warm = [start_to_ready(env, extra) for _ in range(3)]
    print(f"start to ready, empty cache : {cold:.2f} s")
    print(f"start to ready, warm cache  : {', '.join(f'{w:.2f}' for w in warm)} s (best {min(warm):.2f} s)")


if __name__ == "__main__":
    main()
