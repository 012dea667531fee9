"""Retrieval at the gateway: `POST /v1/retrieve`, and chat answers grounded in what an index
finds (`retrieval: {"index": ..., "top_k": ...}`, shoal's extension).

A grounded chat has the passages put into its system message, in the order of their ids (not of
their scores), so that requests that retrieve the same passages share one prompt prefix: the prefix
cache and the KV-aware router reuse its K/V across them. (`"order": "score"` puts the best first,
as most RAG pipelines do, and gives that up: benchmarks/rag.py measures what it costs.) The
answer names the passages it was given (`retrieval` in the body of a non-streamed answer, the
`x-shoal-retrieval` header of both kinds)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx
from fastapi.responses import Response, StreamingResponse

from shoal.protocol.errors import APIError
from shoal.retrieval.router import RetrievalIndexConfig, RetrievalRouter, Retrieved

MAX_TOP_K = 50
HEADER = "x-shoal-retrieval"

# (text, model) -> its embedding, through the fleet (the request's tenant and priority)
FleetEmbedder = Callable[[str, str | None], Awaitable[list[float]]]


class Grounding:
    def __init__(self, indexes: list[RetrievalIndexConfig], http: httpx.AsyncClient, metrics):
        self.http = http
        self.routers = {c.name: RetrievalRouter(c, http, metrics) for c in indexes}

    async def start(self) -> None:
        for r in self.routers.values():
            await r.start()

    async def stop(self) -> None:
        for r in self.routers.values():
            await r.stop()

    def router(self, name) -> RetrievalRouter:
        r = self.routers.get(name) if isinstance(name, str) else None
        if r is None:
            known = ", ".join(sorted(self.routers)) or "none"
            message = f"no retrieval index {str(name)[:100]!r} (this gateway has: {known})"
            raise APIError(404, message, "index")
        return r

    async def retrieve(
        self, spec: dict, text: str | None, model: str | None, embed: FleetEmbedder
    ) -> Retrieved:
        """Searches the index `spec` names (`index`, `top_k`, or a `vector` instead of `text`)."""
        router = self.router(spec.get("index"))
        top_k = spec.get("top_k", router.config.top_k)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= MAX_TOP_K:
            raise APIError(400, f"top_k must be an integer from 1 to {MAX_TOP_K}", "top_k")
        vector = spec.get("vector")
        if vector is None:
            if not text:
                raise APIError(400, "nothing to retrieve for: give input text (or a vector)", "input")
            vector = await self._embed(router.config, text, model, embed)
        elif not isinstance(vector, list) or not vector or not all(_number(x) for x in vector):
            raise APIError(400, "vector must be a non-empty list of numbers", "vector")
        return await router.search(vector, top_k)

    async def _embed(self, cfg: RetrievalIndexConfig, text: str, model: str | None, embed) -> list[float]:
        if cfg.embed_model is None and model is None:
            raise APIError(400, "model is required: the model that embeds the query", "model")
        if cfg.embed_url is None:
            return await embed(text, cfg.embed_model or model)
        resp = await self.http.post(
            cfg.embed_url.rstrip("/") + "/v1/embeddings",
            json={"model": cfg.embed_model or model, "input": text},
            timeout=30,
        )
        if resp.status_code != 200:
            message = f"embedding the query failed (HTTP {resp.status_code})"
            raise APIError(502, message, code="retrieval_failed")
        return resp.json()["data"][0]["embedding"]

    async def ground(self, body: dict, embed: FleetEmbedder) -> tuple[dict, dict]:
        """The chat body with its retrieved passages in its system message, and what to tell the
        client of them."""
        spec = body.pop("retrieval")
        if not isinstance(spec, dict):
            raise APIError(400, 'retrieval must be an object: {"index": ..., "top_k": ...}', "retrieval")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "a grounded chat needs messages", "messages")
        order = spec.get("order", "id")
        if order not in ("id", "score"):
            raise APIError(400, 'retrieval order must be "id" (stable: K/V reused) or "score"', "order")
        found = await self.retrieve(spec, last_user_text(messages), body.get("model"), embed)
        passages = sorted(found.hits, key=lambda h: h.id) if order == "id" else found.hits
        body = {**body, "messages": with_passages(messages, [h.text or "" for h in passages])}
        return body, answer_note(spec["index"], passages, found)


def last_user_text(messages: list) -> str | None:
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content if isinstance(content, str) else None
    return None


def with_passages(messages: list, texts: list[str]) -> list:
    """The passages, numbered, after the client's own system prompt (or as one)."""
    block = "Passages retrieved for this conversation; cite them by number:\n\n" + "\n\n".join(
        f"[{n}] {t}" for n, t in enumerate(texts, 1)
    )
    first = messages[0]
    if isinstance(first, dict) and first.get("role") == "system" and isinstance(first.get("content"), str):
        return [{**first, "content": first["content"] + "\n\n" + block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def answer_note(index: str, passages, found: Retrieved) -> dict:
    return {
        "index": index,
        "passages": [{"n": n, "id": h.id, "score": round(h.score, 6)} for n, h in enumerate(passages, 1)],
        "partial": found.partial,
        "missed_shards": found.missed,
    }


def annotate(resp: Response, note: dict) -> None:
    """Tells the client which passages its answer was given: a header, and in a non-streamed
    answer's body."""
    resp.headers[HEADER] = json.dumps(note, separators=(",", ":"))
    if resp.status_code != 200 or isinstance(resp, StreamingResponse):
        return
    try:
        body = json.loads(resp.body)
    except ValueError:
        return
    if isinstance(body, dict):
        resp.body = json.dumps({**body, "retrieval": note}).encode()
        resp.headers["content-length"] = str(len(resp.body))


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
