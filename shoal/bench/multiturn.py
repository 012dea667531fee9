"""Multi-turn chat load: conversations that share a system prompt and grow turn by turn.

Each conversation opens with a long message of its own (a document) and then asks short
follow-ups; every turn resends the whole history with the replies actually received, as a chat
client does. Conversations run concurrently, turns within one in order. This is the workload where
routing a conversation back to the replica that holds its KV pays.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass

import httpx

from shoal.bench.report import RequestRecord, format_summary, summarize
from shoal.bench.workload import exact_length_text
from shoal.models.checkpoint import load_tokenizer
from shoal.protocol.sse import sse_lines


@dataclass
class MultiTurnConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    tokenizer: str | None = None
    conversations: int = 8
    turns: int = 5
    system_len: int = 200
    first_len: int = 300  # the opening message of each conversation
    followup_len: int = 40
    output_len: int = 48
    seed: int = 0
    api_key: str | None = None
    json_path: str | None = None


async def chat_turn(
    client: httpx.AsyncClient, model: str, messages: list, cfg: MultiTurnConfig, t0: float, n_in: int
):
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": cfg.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    rec = RequestRecord(start=start - t0, input_len=n_in)
    text = ""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"HTTP {resp.status_code}"
                return rec, text
            async for line in sse_lines(resp.aiter_text()):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    rec.output_tokens = obj["usage"]["completion_tokens"]
                    rec.input_len = obj["usage"]["prompt_tokens"]
                for ch in obj.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter() - start
                        rec.ttft = rec.ttft if rec.ttft is not None else now
                        rec.chunk_times.append(now)
                        text += piece
    except httpx.HTTPError as exc:
        rec.error = type(exc).__name__
        return rec, text
    rec.e2e = time.perf_counter() - start
    rec.ok = rec.ttft is not None
    return rec, text


async def run_multiturn_async(cfg: MultiTurnConfig) -> dict:
    tok = load_tokenizer(cfg.tokenizer)
    rng = random.Random(cfg.seed)
    system = exact_length_text(tok, cfg.system_len, rng)
    openers = [exact_length_text(tok, cfg.first_len, rng) for _ in range(cfg.conversations)]
    followups = [[exact_length_text(tok, cfg.followup_len, rng) for _ in range(cfg.turns)] for _ in openers]
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=600) as client:
        model = cfg.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()

        async def conversation(i: int):
            messages = [{"role": "system", "content": system}]
            for turn in range(cfg.turns):
                user = openers[i] if turn == 0 else followups[i][turn]
                messages.append({"role": "user", "content": user})
                rec, reply = await chat_turn(client, model, messages, cfg, t0, 0)
                records.append(rec)
                if not rec.ok:
                    return
                messages.append({"role": "assistant", "content": reply})

        await asyncio.gather(*(conversation(i) for i in range(cfg.conversations)))
        duration = time.perf_counter() - t0
    summary = summarize(records, duration, None, None)
    summary["config"] = asdict(cfg)
    print(f"{cfg.base_url}: {cfg.conversations} conversations x {cfg.turns} turns, model {model}")
    print(format_summary(summary))
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def run_multiturn(cfg: MultiTurnConfig) -> dict:
    return asyncio.run(run_multiturn_async(cfg))
