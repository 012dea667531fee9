"""Grounded answers (issue 32): the time to first token of chats grounded in passages that repeat
across requests, with the passages in a stable order (by id: every request that retrieves the same
passages shares one prompt prefix, whose K/V the replica's prefix cache keeps) against the order
of their scores (which changes with the question, so little of the prompt is reused).

A corpus of passages is embedded by the bundled model itself (`shoal index build --embed-url`),
served as one flat shard, and put behind a gateway with one replica; each request is a short
question (each its own; the passages repeat) that retrieves `--top-k` passages, streamed, with
a short answer. Each order runs under its own system prompt, so neither finds the other's K/V.

    python benchmarks/rag.py [--passages 12] [--passage-tokens 120] [--top-k 4] [--requests 40]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from llama_cpp_server import wait_until_ok  # this script's folder is on sys.path
from serve_throughput import shoal_server

from shoal.bench.workload import exact_length_text
from shoal.models.checkpoint import load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["rivers", "volcanoes", "violins", "penguins", "trains", "bread", "comets", "chess"]


def start(argv: list[str], ready: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", *argv], stderr=subprocess.DEVNULL)
    wait_until_ok(ready, proc, argv[0], timeout=120)
    return proc


def ttft(url: str, question: str, order: str, run: str, top_k: int) -> tuple[float, int]:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": f"You answer questions briefly. ({run})"},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "retrieval": {"index": "docs", "top_k": top_k, "order": order},
    }
    t0, first, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in obj.get("choices") or []):
                first = time.perf_counter() - t0
            if obj.get("usage"):
                cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first or time.perf_counter() - t0, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--passage-tokens", type=int, default=120)
    ap.add_argument("--top-k", type=int, default=6)  # all of them: the same set, in some order
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--port", type=int, default=8170)
    args = ap.parse_args()
    rng = random.Random(0)
    tok = load_tokenizer(None)
    docs = [
        {
            "id": f"p{i:03d}",
            "text": f"About {TOPICS[i % len(TOPICS)]}: " + exact_length_text(tok, args.passage_tokens, rng),
        }
        for i in range(args.passages)
    ]
    # Every question its own: a repeated one would find its whole prompt cached in either order.
    forms = ["Tell me about {}.", "What do you know of {}?", "Explain {} briefly.", "Why do {} matter?"]
    questions = [
        f.format(t) + f" (#{i})" for i in range(args.requests) for f, t in [(forms[i % 4], TOPICS[i % 8])]
    ]
    pooling = ("--embedding-pooling", "mean")  # by topic: the last token says more of the form
    with tempfile.TemporaryDirectory() as tmp, shoal_server(args.port, "int4", extra=pooling) as url:
        root = Path(tmp)
        (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        build = ["index", "build", "--input", str(root / "docs.jsonl"), "--out", str(root / "idx")]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "shoal.cli",
                *build,
                "--kind",
                "flat",
                "--embed-url",
                url,
                "--embed-model",
                MODEL,
            ],
            check=True,
            capture_output=True,
        )
        shard = start(
            ["index", "serve", str(root / "idx" / "shard-0"), "--port", str(args.port + 1)],
            f"http://127.0.0.1:{args.port + 1}/ready",
        )
        conf = root / "gateway.toml"
        conf.write_text(
            f'[[retrieval]]\nname = "docs"\nshards = [["http://127.0.0.1:{args.port + 1}"]]\n'
            "hedge_ms = 0\nbudget_ms = 2000\n"
        )
        gw_url = f"http://127.0.0.1:{args.port + 2}"
        gw = start(
            ["gateway", "--backend", url, "--port", str(args.port + 2), "--config", str(conf)],
            gw_url + "/ready",
        )
        try:
            print(
                f"{args.passages} passages of {args.passage_tokens} tokens, top {args.top_k} a request, "
                f"{args.requests} requests, each its own question, streamed, one at a time"
            )
            print(f"{'passage order':<20}{'TTFT p50 ms':>13}{'mean ms':>9}{'p90 ms':>9}{'cached tokens':>15}")
            results = {}
            for order in ("score", "id"):
                runs = [ttft(gw_url, q, order, f"run {order}", args.top_k) for q in questions]
                times = sorted(t for t, _ in runs)
                results[order] = (statistics.median(times), statistics.mean(times))
                p50, mean = results[order]
                p90 = times[int(0.9 * len(times))]
                cached = statistics.mean(c for _, c in runs)
                print(f"{order:<20}{p50 * 1000:>13.0f}{mean * 1000:>9.0f}{p90 * 1000:>9.0f}{cached:>15.0f}")
            (p50_s, mean_s), (p50_i, mean_i) = results["score"], results["id"]
            print(f"stable order against score order: p50 {p50_s / p50_i:.2f}x, mean {mean_s / mean_i:.2f}x")
        finally:
            gw.terminate()
            shard.terminate()


if __name__ == "__main__":
    main()
