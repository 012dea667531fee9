"""The cost of a step (issue 26): host work per sequence per decode step, against the bare forward
and sampling of the same batch, and the bundled model's streamed throughput at c=32.

A random checkpoint with the bundled tokenizer's vocabulary and a tiny body (2 layers, hidden 64)
makes the model itself cost almost nothing, so what a step costs beyond its forward is the
engine's own work: scheduling, batch preparation, sampling, output processing, detokenizing.
With `--before REV` the same figures are measured on that commit too (a git worktree), in the
same run, and printed beside these.

    python benchmarks/step_cost.py [--batches 1,32,256] [--before HEAD~3] [--no-serve] [--serve-rounds 3]

With `--before` and several serve rounds, the c=32 runs alternate between the two checkouts and the
median of the rounds' ratios is printed: one pair of runs on a shared machine moved by 10 %.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1}  # fmt: skip
PROMPT_LEN = 32


def decode_steps(ckpt: str, batch: int, steps: int) -> dict:
    """Median wall time of a decode step of `batch` greedy rows through LLMEngine.step, and, where
    this checkout has it, the bare forward + logits + argmax of the same rows."""
    from shoal.engine.sampling_params import SamplingParams
    from shoal.llm import LLM

    llm = LLM(model=ckpt, quantization="none", max_num_seqs=batch, num_blocks=8192,
              max_num_batched_tokens=max(2048, batch * PROMPT_LEN))  # fmt: skip
    engine = llm.engine
    vocab = engine.core.loaded.config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    times = []
    for attempt in range(2):  # the first warms the allocator and the kernels' caches
        for i in range(batch):
            prompt = [rng.randrange(1000, vocab) for _ in range(PROMPT_LEN)]
            engine.add_request(f"r{attempt}-{i}", prompt, params)
        times = []
        before = engine.stats()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            times.append(
                (time.perf_counter() - t0, sum(len(c.delta_token_ids) for o in outs for c in o.outputs))
            )
    # Steps in which every row decoded one token (not the prefill, not the tail of stragglers).
    decode = [t for t, n in times[2:-1] if n == batch]
    out = {"batch": batch, "step_ms": 1000 * statistics.median(decode), "steps": len(decode)}
    after = engine.stats()
    if hasattr(after, "host_seconds"):  # the engine's own account, over every step of the run
        steps_run = after.num_steps - before.num_steps
        out["core_host_us_per_seq"] = 1e6 * (after.host_seconds - before.host_seconds) / steps_run / batch
    runner = getattr(engine.core.executor, "runner", None)
    if hasattr(runner, "time_bare_decode"):
        seconds = runner.time_bare_decode(batch, PROMPT_LEN + steps // 2, max(5, min(steps, 30)))
        out["bare_ms"] = 1000 * seconds
    llm.shutdown() if hasattr(llm, "shutdown") else None
    return out


def measure(ckpt: str, batches: list[int], steps: int, pythonpath: str | None) -> list[dict]:
    """Each batch in a process of its own (the engine sets torch's threads; no state carries over),
    importing shoal from `pythonpath` when given."""
    calls = [f"step_cost.decode_steps({ckpt!r}, {b}, {steps})" for b in batches]
    return [json.loads(in_checkout(call, pythonpath)) for call in calls]


def in_checkout(call: str, checkout: str | None) -> str:
    """`call`, an expression of a script beside this one, printed as JSON by a process of its own
    that imports shoal from `checkout` (None: this one); its last line of output."""
    env = dict(os.environ, PYTHONPATH=checkout) if checkout else dict(os.environ)
    here = str(Path(__file__).parent)
    module = call.split(".", 1)[0]
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); import {module}, shoal; "
        "print('SHOAL_FROM', shoal.__file__, file=sys.stderr); "
        f"print(json.dumps({call}))"
    )
    done = subprocess.run(  # in the checkout measured: `python -c` imports from its folder first
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=checkout or ROOT
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    origin = next(ln for ln in done.stderr.splitlines() if ln.startswith("SHOAL_FROM"))
    if checkout and checkout not in origin:
        raise RuntimeError(f"the worktree's shoal was not the one imported: {origin}")
    return done.stdout.strip().splitlines()[-1]


@contextlib.contextmanager
def worktree(rev: str):
    path = Path(tempfile.mkdtemp(prefix="step-cost-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)  # fmt: skip
    try:
        yield str(path)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


STEP_COUNTERS = (
    "shoal:engine_steps_total",
    "shoal:engine_step_forward_seconds_total",
    "shoal:engine_step_host_seconds_total",
)


def step_counters(url: str) -> dict[str, float]:
    """The engine's own step accounting, from /metrics (absent in a checkout that predates it)."""
    import httpx

    found = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in STEP_COUNTERS:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def serve_c32(port: int, pythonpath: str | None) -> dict:
    """Output tok/s of the c=32 run and, where the server counts them, where its wall time went:
    in forward passes, in the engine's host work between them, and elsewhere (the HTTP front,
    the engine loop idle while requests arrive)."""
    from serve_throughput import shoal_server  # this script's folder is on sys.path

    from shoal.bench.serve import ServeBenchConfig, run_serve_bench

    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    with contextlib.chdir(pythonpath or ROOT), shoal_server(port, "auto", env) as url:
        run_serve_bench(ServeBenchConfig(base_url=url, num_requests=8, max_concurrency=8, input_len=32,
                                         output_len=16))  # fmt: skip
        cfg = ServeBenchConfig(
            base_url=url, num_requests=64, max_concurrency=32, input_len=32, output_len=128
        )
        before, t0 = step_counters(url), time.perf_counter()
        tok_s = run_serve_bench(cfg)["output_token_throughput"]
        wall, after = time.perf_counter() - t0, step_counters(url)
    out = {"tok_s": tok_s}
    if len(after) == len(STEP_COUNTERS):
        steps, forward, host = (after[k] - before[k] for k in STEP_COUNTERS)
        out.update(wall_s=wall, steps=steps, forward_s=forward, host_s=host)
    return out


def print_served(label: str, r: dict) -> None:
    line = f"{label}: {r['tok_s']:.0f} output tok/s"
    if "steps" in r:
        ms = 1000 / r["steps"]
        rest = r["wall_s"] - r["forward_s"] - r["host_s"]
        line += (
            f"; per step of the run {r['wall_s'] * ms:.1f} ms of wall: {r['forward_s'] * ms:.1f} forward, "
            f"{r['host_s'] * ms:.1f} engine host work, {rest * ms:.1f} elsewhere ({r['steps']:.0f} steps)"
        )
    print(line)


def print_table(label: str, rows: list[dict]) -> None:
    print(f"\n{label}")
    print("| B | ms / step | bare forward + sampling ms | host µs / seq / step | µs / seq / step (all) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        bare = r.get("bare_ms")
        host = f"{1000 * (r['step_ms'] - bare) / r['batch']:.1f}" if bare is not None else "-"
        bare_s = f"{bare:.2f}" if bare is not None else "-"
        per_seq = 1000 * r["step_ms"] / r["batch"]
        print(f"| {r['batch']} | {r['step_ms']:.2f} | {bare_s} | {host} | {per_seq:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--steps", type=int, default=40, help="decode steps per batch")
    ap.add_argument("--before", help="a git revision to measure in the same run, for the ratio")
    ap.add_argument("--no-serve", action="store_true", help="skip the bundled model's c=32 run")
    ap.add_argument("--serve-rounds", type=int, default=1, help="c=32 runs of each checkout, alternating")
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "bench-results" / "step-cost-tiny")
    args = ap.parse_args()
    from shoal.bench.checkpoints import fill_random_weights, write_config

    if not (args.checkpoint / "model.safetensors").exists():
        fill_random_weights(write_config(args.checkpoint, **TINY))
    batches = [int(b) for b in args.batches.split(",")]
    ckpt = str(args.checkpoint)
    with worktree(args.before) if args.before else contextlib.nullcontext() as old:
        after = measure(ckpt, batches, args.steps, None)
        before = measure(ckpt, batches, args.steps, old) if old else None
        served, served_before = [], []
        for _ in range(0 if args.no_serve else args.serve_rounds):
            served.append(serve_c32(args.port, None))
            if old:
                served_before.append(serve_c32(args.port, old))
    print_table("this checkout", after)
    for r in after:
        if "core_host_us_per_seq" in r:
            print(
                f"B={r['batch']}: host work by the core's own count (shoal:engine_step_host_seconds): "
                f"{r['core_host_us_per_seq']:.1f} µs / seq / step (the front's text is not in it)"
            )
    if before:
        print_table(f"at {args.before}", before)
        ratios = " / ".join(f"{b['step_ms'] / a['step_ms']:.2f}x" for a, b in zip(after, before))
        print(f"\nstep time, before / after, B = {args.batches}: {ratios}")
    if served:
        print("\nbundled model, `shoal serve`, c=32 W1 streamed")
    for i, after_run in enumerate(served):
        print_served(f"round {i + 1}, this checkout", after_run)
        if served_before:
            print_served(f"round {i + 1}, at {args.before}", served_before[i])
    if served_before:
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(served, served_before)]
        rounds = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"ratio: {statistics.median(ratios):.2f}x (median; rounds: {rounds})")


if __name__ == "__main__":
    main()
