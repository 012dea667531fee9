"""Seconds from launching `shoal serve` to `/ready` answering 200: with an empty conversion cache
(the first start on a machine: GGUF conversion and kernel build) and with it filled (every start
after).

    python benchmarks/startup.py [--quantization auto|none|int8|int4]  (default: auto, as `shoal serve`)
"""

from __future__ import annotations

import argparse
import tempfile
import time

from shoal.sim.servers import running


def start_to_ready(env: dict, extra: list[str]) -> float:
    """Polled through one client (servers.wait_for): a client built per poll took half a core from
    the start it timed."""
    t0 = time.perf_counter()
    with running(["serve", *extra], env, poll_s=0.05):
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default=None)
    args = ap.parse_args()
    extra = ["--quantization", args.quantization] if args.quantization else []
    with tempfile.TemporaryDirectory() as cache:
        env = {"SHOAL_CACHE_DIR": cache}
        cold = start_to_ready(env, extra)
        warm = [start_to_ready(env, extra) for _ in range(3)]
    print(f"start to ready, empty cache : {cold:.2f} s")
    print(f"start to ready, warm cache  : {', '.join(f'{w:.2f}' for w in warm)} s (best {min(warm):.2f} s)")


if __name__ == "__main__":
    main()
