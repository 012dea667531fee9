"""What a prompt costs to prefill alone and beside others in one step: the bundled model's
seconds per prompt for steps of 1, 2 and 4 prompts of 512 tokens, on one thread. A step's
cost should grow with its prompts, no faster; a kernel whose rows fall out of cache makes the
batched prompts dearer each (2,048 rows through the gate/up projection once cost 1.7x a row what
256 did: the CPU kernels now multiply 512 rows a pass).

With `--before REV` the same steps run on that commit too (a git worktree), the two checkouts
alternating round by round, each first in every other round (this machine's speed moves by tens
of percent within minutes), and each checkout's best round is printed.

    python benchmarks/prefill_batch.py [--before HEAD~1] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time

from step_cost import in_checkout, worktree  # a sibling script's helpers

PROMPT_TOKENS = 512
BATCHES = (1, 2, 4)


def seconds_per_prompt(threads: int, repeats: int) -> dict[int, float]:
    """Each batch's best of `repeats` steps, in seconds per prompt (one forward each: max_tokens 1)."""
    import torch

    from shoal import SamplingParams
    from shoal.llm import LLM

    torch.set_num_threads(threads)
    budget = PROMPT_TOKENS * max(BATCHES)
    llm = LLM(max_model_len=budget, max_num_batched_tokens=budget, max_num_seqs=16, num_threads=threads)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prompts(n: int) -> list[list[int]]:  # fresh ids each time: no prefix is cached
        return [[rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]

    llm.generate(prompts(1), params)  # warm
    best = {}
    for _ in range(repeats):
        for n in BATCHES:
            batch = prompts(n)
            t0 = time.perf_counter()
            llm.generate(batch, params)
            best[n] = min(best.get(n, float("inf")), (time.perf_counter() - t0) / n)
    llm.shutdown()
    return best


def run_in(checkout: str | None, threads: int, repeats: int) -> dict[int, float]:
    """One round in a process of its own, importing shoal from `checkout` (None: this one)."""
    out = json.loads(in_checkout(f"prefill_batch.seconds_per_prompt({threads}, {repeats})", checkout))
    return {int(k): v for k, v in out.items()}


def line(label: str, rounds: list[dict[int, float]]) -> str:
    best = {n: min(r[n] for r in rounds) for n in BATCHES}
    cells = "  ".join(f"{n} x {PROMPT_TOKENS}: {best[n]:.3f} s" for n in BATCHES)
    most = max(BATCHES)
    return f"{label:<8} {cells}   ({most} prompts cost x{best[most] / best[1]:.2f} a lone one each)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None, metavar="REV", help="also measure this commit, alternating")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="steps of each size a round")
    args = ap.parse_args()
    now, before = [], []
    with worktree(args.before) if args.before else contextlib.nullcontext() as old:
        for r in range(args.rounds):  # each checkout first in every other round: the first ran faster
            if old is not None and r % 2 == 0:
                before.append(run_in(old, args.threads, args.repeats))
            now.append(run_in(None, args.threads, args.repeats))
            if old is not None and r % 2 == 1:
                before.append(run_in(old, args.threads, args.repeats))
    print(f"seconds a prompt, prefilled in steps of 1, 2 and 4 ({args.threads} thread(s), best round):")
    if before:
        print(line(args.before, before))
    print(line("this", now))


if __name__ == "__main__":
    main()
