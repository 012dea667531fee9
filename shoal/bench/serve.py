"""`shoal bench serve`: load against any OpenAI-compatible endpoint (shoal, vLLM, llama.cpp).

Speaks HTTP only; the tokenizer is used to build token-exact prompts, never the engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass

import httpx

from shoal.bench.arrivals import Burst, arrival_times
from shoal.bench.report import RequestRecord, format_summary, plot, summarize
from shoal.bench.workload import BenchRequest, check_length_range, from_dataset, synthetic
from shoal.models.checkpoint import load_tokenizer
from shoal.protocol.sse import sse_lines


@dataclass
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # the id to send; default: the endpoint's first model
    # Several ids, request i sending models[i % len(models)] (LoRA adapters mixed in one batch)
    models: tuple[str, ...] = ()
    tokenizer: str | None = None  # checkpoint whose tokenizer sizes prompts; default: bundled
    endpoint: str = "completions"  # or "chat"
    num_requests: int = 64
    input_len: int = 32
    output_len: int = 128
    # Synthetic lengths drawn uniformly between these (both in) instead of the fixed ones: requests
    # of one length from a capped set of clients start and end in lockstep cohorts.
    input_len_range: tuple[int, int] | None = None
    output_len_range: tuple[int, int] | None = None
    dataset: str | None = None
    request_rate: float = math.inf  # Poisson arrivals per second; inf sends all at once
    # Spells of a higher rate (seconds from the first send, and the rate's multiple): the sends
    # then follow arrival_times' schedule, the one the simulator draws for the same bursts.
    bursts: tuple[Burst, ...] = ()
    max_concurrency: int | None = None
    ignore_eos: bool = True
    seed: int = 0
    api_key: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 600.0
    json_path: str | None = None
    plot_path: str | None = None

    def __post_init__(self):
        check_length_range("input", self.input_len_range)
        check_length_range("output", self.output_len_range)


def _payload(cfg: ServeBenchConfig, model: str, req: BenchRequest) -> tuple[str, dict]:
    common = {
        "model": model,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": req.output_len,
    }
    if cfg.ignore_eos:
        common["ignore_eos"] = True
    if cfg.endpoint == "chat":
        messages = req.messages or [{"role": "user", "content": req.prompt}]
        return "/v1/chat/completions", {**common, "messages": messages}
    return "/v1/completions", {**common, "prompt": req.prompt}


async def _one(
    client: httpx.AsyncClient, cfg: ServeBenchConfig, model: str, req: BenchRequest, t0: float
) -> RequestRecord:
    path, body = _payload(cfg, model, req)
    start = time.perf_counter()
    rec = RequestRecord(start=start - t0, input_len=req.input_len)
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"HTTP {resp.status_code}"
                return rec
            async for line in sse_lines(resp.aiter_text()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = obj["error"].get("type") or "stream error"
                    return rec
                if obj.get("usage"):
                    rec.output_tokens = obj["usage"].get("completion_tokens", 0)
                for ch in obj.get("choices") or []:
                    text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter() - start
                        if rec.ttft is None:
                            rec.ttft = now
                        rec.chunk_times.append(now)
                        chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = type(exc).__name__
        return rec
    rec.e2e = time.perf_counter() - start
    rec.output_tokens = rec.output_tokens or chunks  # servers without usage chunks: one token a chunk
    rec.ok = rec.ttft is not None
    if not rec.ok:
        rec.error = "no output"
    return rec


async def _first_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_serve_bench_async(cfg: ServeBenchConfig) -> dict:
    tok = load_tokenizer(cfg.tokenizer)
    chat = cfg.endpoint == "chat"
    if cfg.dataset:
        requests = from_dataset(cfg.dataset, tok, cfg.num_requests, cfg.output_len, cfg.seed, chat)
    else:
        requests = synthetic(
            tok,
            cfg.num_requests,
            cfg.input_len,
            cfg.output_len,
            cfg.seed,
            chat,
            cfg.input_len_range,
            cfg.output_len_range,
        )
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(
        max_connections=cfg.max_concurrency or len(requests), max_keepalive_connections=None
    )
    async with httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, timeout=cfg.timeout_s, limits=limits
    ) as client:
        model = cfg.model or await _first_model(client)
        gate = asyncio.Semaphore(cfg.max_concurrency or len(requests))
        rng = random.Random(cfg.seed)

        async def limited(req: BenchRequest, name: str) -> RequestRecord:
            async with gate:
                return await _one(client, cfg, name, req, t0)

        schedule = arrival_times(len(requests), cfg.request_rate, cfg.bursts, rng) if cfg.bursts else None
        t0, cpu0 = time.perf_counter(), time.process_time()
        tasks = []
        for i, req in enumerate(requests):
            if schedule is not None:
                await asyncio.sleep(max(0.0, t0 + schedule[i] - time.perf_counter()))
            name = cfg.models[i % len(cfg.models)] if cfg.models else model
            tasks.append(asyncio.create_task(limited(req, name)))
            if schedule is None and math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        client_cpu_s = time.process_time() - cpu0
    summary = summarize(
        records,
        duration,
        cfg.slo_ttft_ms / 1000 if cfg.slo_ttft_ms else None,
        cfg.slo_tpot_ms / 1000 if cfg.slo_tpot_ms else None,
    )
    summary["config"] = asdict(cfg)
    summary["model"] = model
    # What the client itself spent, sending and reading (not building prompts): a client on the
    # server's host takes this from it, and a figure near the duration means the client limited it.
    summary["client_cpu_s"] = client_cpu_s
    print(
        f"{cfg.base_url} {cfg.endpoint}, model {model}: {len(requests)} requests, "
        f"concurrency {cfg.max_concurrency or 'unbounded'}, rate {cfg.request_rate} req/s"
    )
    print(format_summary(summary))
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump({**summary, "records": [asdict(r) for r in records]}, f, indent=2, default=str)
    if cfg.plot_path:
        plot(records, cfg.plot_path)
    return summary


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    return asyncio.run(run_serve_bench_async(cfg))
