"""The tiers policy against sending everything to the strong model (issue 18): one fleet serves
the bundled model twice, int4 as the cheap tier and fp32 as the strong one, with a tiers route
per confidence threshold. A mixed workload (short questions, longer tasks, long documents) runs
greedy against the strong model alone, then against each route. Prints, per route: the share
escalated (by rule), the tokens each model processed (from the replicas' own counters), and how
often the answer equals the strong model's.

    python benchmarks/tiers.py [--thresholds 0.2,0.3,0.4,0.5] [--max-prompt-tokens 200] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

import httpx
from fleet_process import FleetProcess, metric  # this script's folder is on sys.path

from shoal.kernels.build import cpu_model_name

QUESTIONS = [
    "What is the capital of France?",
    "What color is the sky on a clear day?",
    "How many legs does a spider have?",
    "Name the largest planet in the solar system.",
    "What is 12 times 12?",
    "Translate 'thank you' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Give a synonym for 'happy'.",
    "What is the chemical symbol for gold?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence why the sea is salty.",
    "List three uses of a paperclip.",
    "What is the square root of 144?",
    "Suggest a name for a pet goldfish.",
    "Describe the taste of a lemon in a few words.",
    "What does a bee make?",
    "What is the opposite of 'ancient'?",
    "Write one sentence encouraging someone to learn to code.",
    "Why do we have seasons? Answer briefly.",
    "Compose a limerick about a cat who loves the rain.",
    "Summarize the plot of Cinderella in two sentences.",
    "What are the primary colors?",
    "Give me a tip for sleeping better.",
]
DOCUMENT = (
    "The city council met on Tuesday to discuss the new bicycle lanes planned for the river "
    "district. Residents raised concerns about parking, while cyclists praised the plan for "
    "improving safety. The council agreed to run a six-month trial before a final vote. "
)


def workload(n_long: int) -> list[list[dict]]:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    for i in range(n_long):
        doc = DOCUMENT * (4 + i % 3)
        chats.append([{"role": "user", "content": f"{doc}\nSummarize the text above in one sentence."}])
    return chats


def config(path: str, thresholds: list[float], max_prompt_tokens: int) -> None:
    routes = "".join(
        f'[[tiers]]\nname = "auto-{t:g}"\ncheap = "cheap"\nstrong = "strong"\n'
        f"max_prompt_tokens = {max_prompt_tokens}\nmin_confidence = {t}\n\n"
        for t in thresholds
    )
    with open(path, "w") as f:
        f.write(
            '[[models]]\nname = "cheap"\nreplica_args = ["--threads", "1", "--quantization", "int4"]\n\n'
            '[[models]]\nname = "strong"\nreplica_args = ["--threads", "1", "--quantization", "none"]\n\n'
            + routes
        )


def tokens_by_model(url: str) -> dict[str, float]:
    reps = httpx.get(url + "/replicas", timeout=10).json()["replicas"]
    out: dict[str, float] = {}
    for r in reps:
        n = metric(r["url"], "shoal:prompt_tokens_total") + metric(r["url"], "shoal:generation_tokens_total")
        out[r["model"]] = out.get(r["model"], 0.0) + n
    return out


async def run(url: str, model: str, chats: list[list[dict]], max_tokens: int) -> list[dict]:
    """One request at a time, so each model's own speed shows in the wall time."""
    out = []
    async with httpx.AsyncClient(timeout=300) as client:
        for messages in chats:
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            out.append(
                {
                    "text": r.json()["choices"][0]["message"]["content"],
                    "tier": r.headers.get("x-shoal-tier", "strong"),
                    "reason": r.headers.get("x-shoal-tier-reason", ""),
                }
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--thresholds", default="0.2,0.3,0.4,0.5", help="min_confidence of each route")
    p.add_argument("--max-prompt-tokens", type=int, default=200, help="longer prompts go to the strong tier")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--long", type=int, default=6, help="long-document prompts in the mix")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    thresholds = [float(t) for t in a.thresholds.split(",")]
    chats = workload(a.long)
    cfg = os.path.join(tempfile.mkdtemp(prefix="shoal-tiers-"), "fleet.toml")
    config(cfg, thresholds, a.max_prompt_tokens)
    fleet = FleetProcess(["--config", cfg], "")
    report: dict = {"cpu": cpu_model_name(), "requests": len(chats), "routes": {}}
    try:
        fleet.wait_ready(2)
        asyncio.run(run(fleet.url, "strong", chats[:2], a.max_tokens))  # warm both
        asyncio.run(run(fleet.url, "cheap", chats[:2], a.max_tokens))
        before, t0 = tokens_by_model(fleet.url), time.perf_counter()
        reference = asyncio.run(run(fleet.url, "strong", chats, a.max_tokens))
        after = tokens_by_model(fleet.url)
        base_strong = after.get("strong", 0) - before.get("strong", 0)
        report["strong_only"] = {"strong_tokens": base_strong, "seconds": time.perf_counter() - t0}
        print(
            f"{len(chats)} requests ({a.long} long), greedy, at most {a.max_tokens} tokens; "
            f"{cpu_model_name()}"
        )
        print(f"strong only: {base_strong:.0f} strong-model tokens, {report['strong_only']['seconds']:.1f} s")
        print(
            f"{'route':<10} {'escalated':>9} {'by conf':>7} {'by len':>6} {'strong tok':>10} "
            f"{'vs all':>6} {'cheap tok':>9} {'agree':>6} {'agree cheap':>11} {'s':>6}"
        )
        for t in thresholds:
            route = f"auto-{t:g}"
            before, t0 = tokens_by_model(fleet.url), time.perf_counter()
            answers = asyncio.run(run(fleet.url, route, chats, a.max_tokens))
            seconds = time.perf_counter() - t0
            after = tokens_by_model(fleet.url)
            strong = after.get("strong", 0) - before.get("strong", 0)
            cheap = after.get("cheap", 0) - before.get("cheap", 0)
            escalated = [x for x in answers if x["tier"] == "strong"]
            agree = [x["text"] == ref["text"] for x, ref in zip(answers, reference, strict=True)]
            kept = [ag for ag, x in zip(agree, answers, strict=True) if x["tier"] == "cheap"]
            row = {
                "escalated": len(escalated) / len(answers),
                "by_confidence": sum(x["reason"] == "confidence" for x in answers),
                "by_length": sum(x["reason"] == "length" for x in answers),
                "strong_tokens": strong,
                "strong_tokens_vs_all": strong / base_strong if base_strong else float("nan"),
                "cheap_tokens": cheap,
                "agreement": sum(agree) / len(agree),
                "agreement_cheap_answers": sum(kept) / len(kept) if kept else float("nan"),
                "seconds": seconds,
            }
            report["routes"][route] = row
            print(
                f"{route:<10} {row['escalated']:>9.0%} {row['by_confidence']:>7} {row['by_length']:>6} "
                f"{strong:>10.0f} {row['strong_tokens_vs_all']:>6.0%} {cheap:>9.0f} {row['agreement']:>6.0%} "
                f"{row['agreement_cheap_answers']:>11.0%} {seconds:>6.1f}"
            )
    finally:
        fleet.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
