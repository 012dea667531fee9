"""Mixture of experts (issue 30): decode throughput of a random Mixtral-shaped checkpoint at c=1, 8
and 32 with its experts on 1, 2 and 3 ranks (expert parallelism; attention split by heads over
the same ranks), each way of reaching the experts (all-reduce: every rank routes every token and a
sum combines; all-to-all: each rank routes its share and trades tokens with the experts' ranks),
the time a step spends in the ranks' collectives (those and attention's all-reduce; of them, the
sparse layers' dispatch and combine), and a dense model of the same active parameter
count (intermediate size = top_k x an expert's) on one process for comparison; then the load of
each rank under a skewed router (two experts' router rows scaled up), max over mean, with the
static placement and with the engine replicating hot experts into 2 spare slots a rank.

Shape: hidden 384, 6 heads over 3 KV heads, 12 layers, 6 experts of intermediate 512, top 2; the
bundled model's tokenizer. fp32 weights; 32-token prompts, 64 greedy tokens, EOS ignored.

    python benchmarks/moe.py [--eps 1,2,3] [--concurrency 1,8,32] [--tokens 64]
        [--dispatch all-reduce,all-to-all]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from shoal import LLM, SamplingParams
from shoal.bench.checkpoints import fill_random_weights, write_config

SHAPE = {"hidden_size": 384, "num_attention_heads": 6, "num_key_value_heads": 3, "num_hidden_layers": 12}
MOE = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": 512,
       "num_local_experts": 6, "num_experts_per_tok": 2}  # fmt: skip
DENSE = {"intermediate_size": 1024}  # top_k x an expert's: the same active parameters per token


def decode_rate(llm: LLM, conc: int, tokens: int) -> float:
    prompts = [[1000 + 7 * i + j for j in range(32)] for i in range(conc)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def collectives_per_step(llm: LLM) -> tuple[float, float, float] | None:
    """Seconds a step spends in collectives: all of them, and of those the sparse layers' sending
    tokens to their experts and putting the outputs together (the busiest rank's)."""
    stats = llm.engine.core.stats().ranks
    if not stats:
        return None
    per_step = [(s.comm_s, s.moe_dispatch_s, s.moe_combine_s) for s in stats]
    return tuple(max(x[i] / max(1, s.steps) for x, s in zip(per_step, stats)) for i in range(3))


def skew_router(ckpt: Path, hot: tuple[int, ...], factor: float) -> Path:
    """A copy of `ckpt` whose router favours the `hot` experts (their rows scaled by `factor`)."""
    out = ckpt.parent / f"{ckpt.name}-skewed"
    out.mkdir(exist_ok=True)
    for f in ckpt.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(ckpt / "model.safetensors"))
    for name, t in weights.items():
        if name.endswith("block_sparse_moe.gate.weight"):
            t[list(hot)] *= factor
    save_file(weights, str(out / "model.safetensors"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", default="1,2,3")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dispatch", default="all-reduce,all-to-all")
    args = ap.parse_args()
    dispatches = args.dispatch.split(",")
    eps = [int(x) for x in args.eps.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        moe = fill_random_weights(write_config(Path(tmp) / "moe", **SHAPE, **MOE))
        dense = fill_random_weights(write_config(Path(tmp) / "dense", **SHAPE, **DENSE))
        with LLM(str(dense), num_blocks=2048, max_num_seqs=64) as llm:
            rows.append(
                ("dense, same active parameters", 1, [decode_rate(llm, c, args.tokens) for c in concs], None)
            )
        shapes = [(ep, d) for ep in eps for d in (dispatches if ep > 1 else ["-"])]
        for ep, dispatch in shapes:
            how = {} if ep == 1 else {"expert_dispatch": dispatch}
            with LLM(str(moe), expert_parallel_size=ep, num_blocks=2048, max_num_seqs=64, **how) as llm:
                rates = [decode_rate(llm, c, args.tokens) for c in concs]
                name = f"MoE, experts on {ep} rank{'s' if ep > 1 else ''}" + (f", {dispatch}" if how else "")
                rows.append((name, ep, rates, collectives_per_step(llm)))
        skewed = skew_router(moe, (0, 1), 4.0)
        balance = []
        for ep, dispatch in [s for s in shapes if s[0] > 1]:
            for spares in (0, 2):
                opts = dict(expert_spare_slots=spares, expert_rebalance_steps=16, expert_dispatch=dispatch)
                with LLM(
                    str(skewed), expert_parallel_size=ep, num_blocks=2048, max_num_seqs=64, **opts
                ) as llm:
                    rate = decode_rate(llm, 8, args.tokens)
                    stats = llm.engine.core.stats().moe_balance
                    balance.append((ep, dispatch, spares, stats.imbalance, stats.rebalances, rate))
    head = " | ".join(f"c={c} tok/s" for c in concs)
    print(f"\n| model | ranks | {head} | collectives ms/step | of which dispatch | combine |")
    print("| --- | --- |" + " --- |" * len(concs) + " --- | --- | --- |")
    for name, ranks, rates, comm in rows:
        cells = " | ".join(f"{r:.0f}" for r in rates)
        times = " | ".join(f"{1000 * t:.2f}" for t in comm) if comm else "- | - | -"
        print(f"| {name} | {ranks} | {cells} | {times} |")
    print("\n| skewed router (experts 0, 1 favoured), c=8 | rank load max/mean | placements | tok/s |")
    print("| --- | --- | --- | --- |")
    for ep, dispatch, spares, ratio, placements, rate in balance:
        how = f"{spares} spare expert slots a rank" if spares else "static placement"
        print(f"| EP {ep}, {dispatch}, {how} | {ratio:.2f} | {placements} | {rate:.0f} |")


if __name__ == "__main__":
    main()
