"""Offline throughput on a CUDA device, against the HBM roofline.

The bundled GGUF is too large to carry to a lent GPU machine, so this runs a checkpoint of the same
shape (SmolLM2-135M: its config and tokenizer, written here with `prepare`) with random weights:
the arithmetic and bytes per step are the bundled model's. `prepare --size 1b` writes a Llama of
about 1B parameters instead (Llama-3.2-1B's layers over the bundled vocabulary), whose weights take
long enough to read that a step can be bound by memory rather than by its host work.

For each dtype and batch cap it prints output tok/s, ms per engine step (and its split into the
forward and the engine's host work), the share of steps whose forward was queued by the step
before (engine.decode_ahead: `--decode-ahead auto,off` runs with and without), and the step time
that reading the weights and KV once per step would take at the device's copy bandwidth (measured
in the same run): the roofline a decode step cannot beat.

    python benchmarks/gpu_offline.py prepare bench-results/gpu-ckpt       # here (needs the GGUF)
    python benchmarks/gpu_offline.py prepare bench-results/gpu-1b --size 1b
    python benchmarks/gpu_offline.py run bench-results/gpu-ckpt            # on the GPU machine
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from shoal.bench.checkpoints import fill_random_weights, write_config
from shoal.bench.offline import OfflineBenchConfig, make_workload
from shoal.engine.sampling_params import SamplingParams
from shoal.llm import LLM
from shoal.models.loader import load_model

SIZES = {
    "smollm2": {},
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
}


def prepare(out: Path, size: str) -> None:
    """config.json and tokenizer files of the bundled model, in HF's layout, at the named size."""
    write_config(out, **SIZES[size])
    print(f"wrote {out}")


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - t0)


def run(
    ckpt: Path, batches: list[int], dtypes: list[str], modes: tuple[bool, ...], aheads: list[str]
) -> None:
    fill_random_weights(ckpt, dtype=torch.bfloat16)
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    cfg = OfflineBenchConfig(num_requests=0, input_len=32, output_len=128)
    print(
        "\n| dtype | decode | ahead | max seqs | requests | output tok/s | ms / step | forward ms | host ms "
        "| steps queued ahead | roofline ms / step | of roof |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in dtypes:
        loaded = load_model(str(ckpt), dtype=getattr(torch, dtype), device="cuda", quantization="none")
        weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        mcfg = loaded.config
        kv_per_token = (
            2
            * mcfg.num_layers
            * mcfg.num_kv_heads
            * mcfg.head_dim
            * torch.finfo(getattr(torch, dtype)).bits
            // 8
        )
        for batch, eager, ahead in [(b, e, a) for b in batches for e in modes for a in aheads]:
            cfg.num_requests = max(2 * batch, 8)
            work = make_workload(cfg, mcfg.vocab_size)
            llm = LLM(
                loaded=loaded,
                device="cuda",
                dtype=dtype,
                max_num_seqs=batch,
                num_blocks=4096,
                enforce_eager=eager,
                decode_ahead=ahead,
            )
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
            llm.generate(work.prompts[:batch], params[:batch])  # warm-up: allocator, kernels
            core = llm.engine.core
            ahead_on = core.executor.runner.ahead is not None
            steps0, fwd0, host0 = core.num_steps, core.times.forward_seconds, core.times.host_seconds
            taken0 = core.times.steps_from_queue
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(work.prompts, params)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            steps = core.num_steps - steps0
            fwd_ms = 1000 * (core.times.forward_seconds - fwd0) / steps
            host_ms = 1000 * (core.times.host_seconds - host0) / steps
            # A decode step at full batch reads every weight once and each sequence's KV (mean
            # context: prompt + half the output).
            mean_ctx = cfg.input_len + cfg.output_len / 2
            roof_ms = 1000 * (weight_bytes + batch * mean_ctx * kv_per_token) / bw
            step_ms = 1000 * elapsed / steps
            mode = "eager" if eager else "graphs"
            queued = f"{(core.times.steps_from_queue - taken0) / steps:.0%}" if ahead_on else "-"
            print(
                f"| {dtype} | {mode} | {ahead} | {batch} | {cfg.num_requests} | "
                f"{work.total_output / elapsed:.0f} | {step_ms:.2f} | {fwd_ms:.2f} | {host_ms:.2f} | "
                f"{queued} | "
                f"{roof_ms:.3f} | {roof_ms / step_ms:.1%} |"
            )
            del llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["prepare", "run"])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="smollm2", help="prepare: the shape")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--graphs-only", action="store_true", help="skip the eager runs")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--decode-ahead", default="auto", help="comma-separated: auto, on, off (each a run)")
    args = ap.parse_args()
    if args.action == "prepare":
        prepare(args.checkpoint, args.size)
    else:
        modes = (False,) if args.graphs_only else (True, False)
        batches = [int(b) for b in args.batches.split(",")]
        run(args.checkpoint, batches, args.dtypes.split(","), modes, args.decode_ahead.split(","))


if __name__ == "__main__":
    main()
