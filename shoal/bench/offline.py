"""`shoal bench offline`: engine throughput on synthetic requests, optionally against HF transformers.

Unlike the rest of shoal/bench (which only speaks HTTP), this drives the engine in-process: offline
throughput has no endpoint to call. It is the one place in this package that imports the engine.
"""

from __future__ import annotations

import json
import random
import resource
import time
from dataclasses import asdict, dataclass

import torch

from shoal.engine.runner_setup import DTYPES
from shoal.engine.sampling_params import SamplingParams
from shoal.llm import LLM
from shoal.models.loader import load_model, resolve_model


@dataclass
class OfflineBenchConfig:
    num_requests: int = 64
    input_len: int = 32
    output_len: int = 128
    input_len_range: tuple[int, int] | None = None
    output_len_range: tuple[int, int] | None = None
    seed: int = 0
    compare_hf: bool = False
    hf_batch_size: int = 32
    json_path: str | None = None


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def total_output(self) -> int:
        return sum(self.output_lens)

    @property
    def total_input(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(cfg: OfflineBenchConfig, vocab_size: int) -> Workload:
    rng = random.Random(cfg.seed)
    prompts, outs = [], []
    for _ in range(cfg.num_requests):
        n_in = rng.randint(*cfg.input_len_range) if cfg.input_len_range else cfg.input_len
        n_out = rng.randint(*cfg.output_len_range) if cfg.output_len_range else cfg.output_len
        # Ids well clear of the special tokens at the start of the vocabulary.
        prompts.append([rng.randrange(1000, vocab_size) for _ in range(n_in)])
        outs.append(n_out)
    return Workload(prompts, outs)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_shoal(llm: LLM, work: Workload, ignore_eos: bool = True) -> dict:
    engine = llm.engine
    engine.core.measure_occupancy = True
    for i, (prompt, n_out) in enumerate(zip(work.prompts, work.output_lens)):
        params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=ignore_eos)
        engine.add_request(f"bench-{i}", prompt, params)
    peak_alloc, samples_at_peak, waste_sum, steps = 0, [], 0.0, 0
    generated = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        generated += sum(len(c.delta_token_ids) for o in outs for c in o.outputs)
        used, alloc = engine.core.last_kv_occupancy
        if alloc:
            waste = (alloc - used) / alloc
            waste_sum += waste
            steps += 1
            if alloc > peak_alloc:
                peak_alloc, samples_at_peak = alloc, [waste]
            elif alloc == peak_alloc:
                samples_at_peak.append(waste)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    return {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + work.total_input) / elapsed,
        "steps": engine.core.num_steps,
        "peak_rss_mib": peak_rss_mib(),
        "kv_peak_allocated_slots": peak_alloc,
        "kv_waste_at_peak": sum(samples_at_peak) / max(1, len(samples_at_peak)),
        "kv_waste_mean": waste_sum / max(1, steps),
        "preemptions": stats.num_preemptions,
        **spec_figures(stats.spec),
    }


def spec_figures(spec) -> dict:
    """Speculative decoding's counters, when it is on."""
    if spec is None:
        return {}
    return {
        "spec_draft_tokens": spec.num_draft_tokens,
        "spec_accepted_tokens": spec.num_accepted_tokens,
        "spec_acceptance_rate": spec.acceptance_rate,
        "spec_accepted_per_position": list(spec.accepted_per_position),
    }


def run_hf(model_arg: str | None, work: Workload, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    _, path = resolve_model(model_arg)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    start = time.perf_counter()
    for b in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[b : b + batch_size]
        new = max(work.output_lens[b : b + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            # Static batch: every row runs to the longest output; min_new_tokens keeps EOS out.
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "output_tok_s": work.total_output / elapsed,
        "total_tok_s": (work.total_output + work.total_input) / elapsed,
        "batch_size": batch_size,
    }


def run_offline_bench(cfg: OfflineBenchConfig, model: str | None, engine_options: dict) -> dict:
    options = dict(engine_options)
    loaded = load_model(
        model,
        dtype=DTYPES[options.get("dtype", "float32")],
        device=options.get("device", "cpu"),
        quantization=options.get("quantization", "auto"),
    )
    work = make_workload(cfg, loaded.config.vocab_size)
    if "kv_cache_memory" not in options and "num_blocks" not in options:
        # Size the pool for the workload at its longest: a benchmark of batching, not of preemption.
        bs = options.get("block_size", 16)
        blocks = sum(-(-(len(p) + o) // bs) for p, o in zip(work.prompts, work.output_lens))
        options["num_blocks"] = int(blocks * 1.1) + 1
    llm = LLM(model, loaded=loaded, **options)
    print(
        f"workload: {cfg.num_requests} requests, {work.total_input} prompt tokens, "
        f"{work.total_output} output tokens (EOS ignored), model {llm.engine.model_name}"
    )
    result = {"config": asdict(cfg), "shoal": run_shoal(llm, work)}
    s = result["shoal"]
    print(
        f"shoal : {s['output_tok_s']:8.1f} output tok/s  {s['total_tok_s']:8.1f} total tok/s  "
        f"{s['elapsed_s']:.1f} s  peak RSS {s['peak_rss_mib']:.0f} MiB  "
        f"KV waste at peak {100 * s['kv_waste_at_peak']:.2f}% (mean {100 * s['kv_waste_mean']:.2f}%)  "
        f"preemptions {s['preemptions']}"
    )
    if "spec_draft_tokens" in s:
        print(
            f"speculative: {s['spec_accepted_tokens']} of {s['spec_draft_tokens']} proposed tokens "
            f"accepted ({100 * s['spec_acceptance_rate']:.1f}%), "
            f"by position {s['spec_accepted_per_position']}"
        )
    if cfg.compare_hf:
        del llm
        h = result["hf"] = run_hf(model, work, cfg.hf_batch_size)
        result["ratio_output_tok_s"] = s["output_tok_s"] / h["output_tok_s"]
        print(
            f"HF    : {h['output_tok_s']:8.1f} output tok/s  {h['total_tok_s']:8.1f} total tok/s  "
            f"{h['elapsed_s']:.1f} s  (static batches of {cfg.hf_batch_size})"
        )
        print(f"ratio : {result['ratio_output_tok_s']:.2f}x HF output tok/s")
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result
