"""Speculative decoding against plain decoding, in one run: output tok/s and acceptance rate at
concurrency 1 and 8 (offline engine, greedy), with and without each proposer, on
(a) W1: 32-token random prompts, 128 tokens, EOS ignored, and
(b) a repetition-heavy workload: chat requests to rewrite a passage given in the prompt.

    python benchmarks/speculative.py [--targets auto:ngram,none:ngram+draft] [-k 4]

Each target (its weights: auto is the bundled GGUF's int4, none is fp32) runs without speculation
and with each proposer named for it; the draft is the bundled model in int4.
"""

from __future__ import annotations

import argparse
import time

from shoal import LLM
from shoal.bench.offline import OfflineBenchConfig, Workload, make_workload, run_shoal
from shoal.kernels.build import cpu_model_name
from shoal.models.loader import load_model

# About 120 tokens each: a faithful rewrite fills the 128-token output.
PASSAGES = [
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
    "and watched the ships pass safely through the narrow strait. In winter the wind rattled the "
    "windows and the waves broke over the rocks below, but the light never failed. Each morning he "
    "wrote in his logbook the names of the ships he had seen, the weather, and the hour the lamp went "
    "out. When the government replaced him with an automatic beacon, he moved to a cottage in the "
    "village and kept writing his logbook anyway, from memory and from the window.",
    "Bread dough needs time. Mix the flour, water, salt and yeast, then knead the dough for ten "
    "minutes until it is smooth and springs back when pressed. Let it rise in a warm place until it "
    "has doubled in size, which takes about an hour. Knock it back, shape it into a loaf, and leave "
    "it to rise again for half an hour. Bake it in a hot oven for thirty minutes, until the crust is "
    "brown and the loaf sounds hollow when tapped underneath. Let it cool before slicing it.",
    "A river begins as a spring in the hills and gathers small streams as it runs down the valley. "
    "Where the slope is steep it cuts a narrow channel and carries stones and sand; where the land "
    "flattens it slows, winds from side to side, and drops the sand on its inner bends. Near the "
    "coast it spreads into a wide delta of channels and marshes where fresh water meets the sea, and "
    "the mud it brought from the hills builds new land, year after year, grain by grain.",
    "The library opens at nine in the morning and closes at six in the evening, except on Sundays. "
    "Books may be borrowed for three weeks and renewed twice, unless another reader has reserved "
    "them. Reference books, newspapers and rare maps stay in the reading room. Readers under twelve "
    "need a parent to sign their card. Lost books are charged at the price of a new copy, and late "
    "returns pay a small fine for each day, which goes to buying new books for the children's room.",
]
ASKS = ["Rewrite this passage exactly, word for word:", "Copy out the following text without changes:"]


def rewrite_workload(llm: LLM, n: int, output_len: int) -> Workload:
    prompts = []
    for i in range(n):
        ask = f"{ASKS[i % len(ASKS)]}\n\n{PASSAGES[i % len(PASSAGES)]}"
        prompts.append(llm.tokenizer.encode_chat([{"role": "user", "content": ask}]))
    return Workload(prompts, [output_len] * n)


def run_config(loaded, target: str, methods: list[str | None], k: int, rows: list) -> None:
    for conc in (1, 8):
        n = 4 if conc == 1 else 16
        for name in ("W1", "rewrite"):
            for method in methods:
                spec = {"speculative": method, "num_speculative_tokens": k} if method else {}
                llm = LLM(loaded=loaded, max_num_seqs=conc, num_blocks=2048, **spec)
                if name == "W1":
                    work = make_workload(
                        OfflineBenchConfig(num_requests=n, input_len=32, output_len=128), 49152
                    )
                else:
                    work = rewrite_workload(llm, n, 128)
                llm.generate(work.prompts[0][:8], None)  # warm up kernels and caches
                t0 = time.perf_counter()
                r = run_shoal(llm, work, ignore_eos=name == "W1")
                rate = r.get("spec_acceptance_rate")
                row = (
                    target,
                    conc,
                    name,
                    method or "off",
                    r["output_tok_s"],
                    r["output_tokens"],
                    r["steps"],
                    rate,
                )
                rows.append(row)
                acc = f"{100 * rate:.0f}%" if rate is not None else "-"
                print(
                    f"{target} c={conc} {name:7s} {method or 'off':6s}: "
                    f"{r['output_tok_s']:6.1f} output tok/s, "
                    f"{r['output_tokens']} tokens in {r['steps']} steps ({time.perf_counter() - t0:.1f} s), "
                    f"acceptance {acc} {r.get('spec_accepted_per_position', '')}"
                )
                del llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--targets",
        default="auto:ngram,none:ngram+draft",
        help="target weights and the proposers to try on each: QUANT:METHOD+METHOD,...",
    )
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    args = ap.parse_args()
    print(f"CPU: {cpu_model_name()}; drafts: the bundled model in int4")
    rows: list = []
    for item in args.targets.split(","):
        quant, methods = item.split(":")
        loaded = load_model(quantization=quant)
        target = loaded.quantization or "fp32"
        run_config(loaded, target, [None, *methods.split("+")], args.num_speculative_tokens, rows)
    print("\n| target | c | workload | proposer | output tok/s | speedup | tokens/step | acceptance |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = {(t, c, w): tok for t, c, w, m, tok, *_ in rows if m == "off"}
    for target, conc, name, method, tok_s, tokens, steps, rate in rows:
        acc = f"{100 * rate:.0f}%" if rate is not None else "-"
        print(
            f"| {target} | {conc} | {name} | {method} | {tok_s:.1f} | "
            f"{tok_s / base[target, conc, name]:.2f}x | {tokens / steps:.2f} | {acc} |"
        )


if __name__ == "__main__":
    main()
