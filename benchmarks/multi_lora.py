"""Many LoRA adapters over the bundled model (issue 28): output tok/s and TTFT p50/p99 at c=8 and
c=32 (32-token prompts, 64 greedy tokens, EOS ignored, streamed) for the base model on a plain
`shoal serve`, the base on a server with --enable-lora, and 1, 8 and 32 distinct adapters in the
batch (request i names adapter i % N), at rank 8 and 16; the time to load an adapter at run time
(vLLM's /v1/load_lora_adapter); and what merging each adapter into the weights per request would
serve instead (fp32 base: merge, generate the request alone, unmerge).

Adapters are random, written in PEFT's layout (adapter_config.json, adapter_model.safetensors) for
every projection of every layer (--targets narrows them: q_proj,v_proj is PEFT's default for Llama).
The served base is the bundled int4 model, so adapters are held in float16 (--lora-dtype auto);
--lora-dtype float32 measures them in float32.

    python benchmarks/multi_lora.py [--ranks 8,16] [--adapters 1,8,32] [--requests-per-stream 2]
        [--targets q_proj,v_proj] [--lora-dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file
from serve_throughput import shoal_server  # this script's folder is on sys.path

from shoal.bench.serve import ServeBenchConfig, run_serve_bench
from shoal.models.loader import load_model
from shoal.models.lora import module_shapes

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
KEY = "multi-lora-bench"


def write_adapter(path: Path, cfg, rank: int, seed: int, targets: list[str]) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (fan_in, fan_out) in module_shapes(cfg).items():
            if module not in targets:
                continue
            prefix = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (path / "adapter_config.json").write_text(json.dumps(config))


def server(port: int, *flags: str):
    return shoal_server(port, "auto", extra=("--api-key", KEY, *flags))


def measure(url: str, conc: int, per_stream: int, models: tuple[str, ...] = ()) -> dict:
    cfg = ServeBenchConfig(base_url=url, api_key=KEY, num_requests=conc * per_stream, max_concurrency=conc,
                           input_len=32, output_len=64, models=models)  # fmt: skip
    s = run_serve_bench(cfg)
    return {
        "tok_s": s["output_token_throughput"],
        "ttft_p50": 1000 * s["ttft_s"]["p50"],
        "ttft_p99": 1000 * s["ttft_s"]["p99"],
    }


def load_at_run_time(url: str, name: str, path: Path) -> float:
    """Seconds vLLM's load route takes to make an adapter servable."""
    t0 = time.perf_counter()
    body = {"lora_name": name, "lora_path": str(path)}
    r = httpx.post(
        url + "/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )
    r.raise_for_status()
    return time.perf_counter() - t0


def merged_per_request(folder: Path, names: list[str], requests: int) -> dict:
    """Each request alone, its adapter merged into the fp32 weights first and taken out after."""
    from shoal.engine.sampling_params import SamplingParams
    from shoal.llm import LLM
    from shoal.models.llama import PACKED_PARTS
    from shoal.models.lora import load_adapter

    llm = LLM(quantization="none", num_blocks=512)
    model = llm.engine.core.loaded.model
    cfg = llm.engine.core.loaded.config
    shapes = module_shapes(cfg)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = list(range(1000, 1032))
    merge_s, tokens, t0 = [], 0, time.perf_counter()

    def apply(adapter, sign: float) -> None:
        for (layer, module), (a, b) in adapter.weights.items():
            fused = next((f for f, parts in PACKED_PARTS.items() if module in parts), module)
            offset = 0
            for part in PACKED_PARTS.get(fused, (fused,)):
                if part == module:
                    break
                offset += shapes[part][1]
            w = getattr(model.layers[layer], fused).weight
            w[offset : offset + b.shape[0]].addmm_(b, a, alpha=sign)

    with torch.inference_mode():
        for i in range(requests):
            adapter = load_adapter(names[i % len(names)], folder / names[i % len(names)], cfg, 64)
            m0 = time.perf_counter()
            apply(adapter, 1.0)
            merge_s.append(time.perf_counter() - m0)
            tokens += len(llm.generate([prompt], params)[0].outputs[0].token_ids)
            apply(adapter, -1.0)
    return {"tok_s": tokens / (time.perf_counter() - t0), "merge_ms": 1000 * statistics.median(merge_s)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="8,16")
    ap.add_argument("--adapters", default="1,8,32")
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--targets", default=",".join(MODULES), help="modules each adapter changes")
    ap.add_argument("--lora-dtype", default="auto", choices=("auto", "float32", "float16"))
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    counts = [int(n) for n in args.adapters.split(",")]
    cfg = load_model().config
    rows = []
    with tempfile.TemporaryDirectory(prefix="multi-lora-") as tmp:
        root = Path(tmp)
        with server(args.port) as url:
            for conc in (8, 32):
                rows.append(("base, plain server", "-", conc, measure(url, conc, args.requests_per_stream)))
        for rank in ranks:
            names = [f"r{rank}-{i}" for i in range(max(counts))]
            for i, name in enumerate(names):
                write_adapter(root / name, cfg, rank, seed=1000 * rank + i, targets=args.targets.split(","))
            first, rest = names[0], names[1:]
            flags = ["--enable-lora", "--max-loras", str(max(counts)), "--max-lora-rank", str(max(ranks)),
                     "--lora-dtype", args.lora_dtype]  # fmt: skip
            with server(args.port, *flags, "--lora-modules", f"{first}={root / first}") as url:
                loads = [load_at_run_time(url, name, root / name) for name in rest]
                print(f"rank {rank}: load_lora_adapter median {1000 * statistics.median(loads):.1f} ms "
                      f"(max {1000 * max(loads):.1f}) over {len(loads)} adapters")  # fmt: skip
                for conc in (8, 32):
                    rows.append(
                        ("base, --enable-lora", rank, conc, measure(url, conc, args.requests_per_stream))
                    )
                    for n in counts:
                        r = measure(url, conc, args.requests_per_stream, tuple(names[:n]))
                        rows.append((f"{n} adapters", rank, conc, r))
            merged = merged_per_request(root, names[:8], 8)
            rows.append(("merged per request (fp32)", rank, 1, {"tok_s": merged["tok_s"], "ttft_p50": None,
                                                                 "ttft_p99": None}))  # fmt: skip
            print(f"rank {rank}: merging one adapter into the fp32 weights: {merged['merge_ms']:.1f} ms")
    print("\n| serving | rank | c | output tok/s | TTFT p50 ms | TTFT p99 ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for what, rank, conc, r in rows:
        p50 = "-" if r["ttft_p50"] is None else f"{r['ttft_p50']:.0f}"
        p99 = "-" if r["ttft_p99"] is None else f"{r['ttft_p99']:.0f}"
        print(f"| {what} | {rank} | {conc} | {r['tok_s']:.0f} | {p50} | {p99} |")
    base32 = next(r["tok_s"] for what, _, c, r in rows if what == "base, plain server" and c == 32)
    for what, rank, conc, r in rows:
        if what == f"{max(counts)} adapters" and conc == 32:
            print(f"rank {rank}: {max(counts)} adapters at c=32 / the plain base: {r['tok_s'] / base32:.2f}x")


if __name__ == "__main__":
    main()
