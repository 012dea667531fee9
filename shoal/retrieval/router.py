"""Scatter-gather over an index's shards: a query goes to one replica of every shard, and their
best hits are merged. Within a latency budget: what has arrived when it runs out is the answer,
marked partial with the shards that missed. A replica slow past `hedge_ms` has the query sent to
a second replica of its shard as well (the first answer wins); a replica that fails is left for
`down_s` and its shard's next replica asked at once. Every replica's /health is probed as well, so
that one that died is left out before a query has to find out (and one that came back is asked
again)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import httpx

from shoal.retrieval.shard import Hit


@dataclass
class RetrievalIndexConfig:
    """One index the gateway retrieves from ([[retrieval]] tables)."""

    name: str = ""
    shards: list[list[str]] = field(default_factory=list)  # each shard's replica URLs
    top_k: int = 5
    budget_ms: float = 250.0
    hedge_ms: float = 50.0  # 0: never hedge
    down_s: float = 2.0
    probe_interval_s: float = 1.0  # every replica's /health, so a dead one is skipped before a query finds it
    api_key: str | None = None  # the shard servers' key
    # Queries are embedded by this fleet model (default: the one the request names), or by any
    # OpenAI-compatible /v1/embeddings server at embed_url.
    embed_model: str | None = None
    embed_url: str | None = None
    search: dict = field(default_factory=dict)  # nprobe, ef_search, k_factor for every query

    def __post_init__(self):
        if not self.name or not self.shards or not all(self.shards):
            raise ValueError("a retrieval index needs a name and at least one replica URL per shard")


@dataclass
class Retrieved:
    hits: list[Hit]
    missed: list[int]  # shards that did not answer within the budget

    @property
    def partial(self) -> bool:
        return bool(self.missed)


class _Replica:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.down_until = 0.0
        self.latency_s = 0.0  # a moving average: the faster replica is asked first
        self.last_seconds = 0.0
        self.probed_down = False

    def observe(self, seconds: float) -> None:
        self.latency_s = seconds if not self.latency_s else 0.8 * self.latency_s + 0.2 * seconds


class ShardFailed(Exception):
    """Every replica of a shard failed the query."""


class RetrievalRouter:
    def __init__(self, config: RetrievalIndexConfig, http: httpx.AsyncClient, metrics=None):
        """`metrics`: the gateway's (GatewayMetrics), or None."""
        self.config = config
        self.http = http
        self.metrics = metrics
        self.shards = [[_Replica(u) for u in urls] for urls in config.shards]
        self._probing: asyncio.Task | None = None

    async def start(self) -> None:
        self._probing = asyncio.create_task(self._probe_forever())

    async def stop(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probing

    async def _probe_forever(self) -> None:
        cfg = self.config
        while True:
            replicas = [(i, r) for i, shard in enumerate(self.shards) for r in shard]
            ups = await asyncio.gather(*(self._healthy(r) for _, r in replicas))
            for (i, r), up in zip(replicas, ups):
                if not up:
                    r.down_until = time.monotonic() + max(cfg.down_s, cfg.probe_interval_s)
                elif r.probed_down:
                    r.down_until = 0.0  # back: asked again at once
                r.probed_down = not up
                if self.metrics is not None:
                    self.metrics.retrieval_replica_up.labels(cfg.name, str(i), r.url).set(int(up))
            await asyncio.sleep(cfg.probe_interval_s)

    async def _healthy(self, r: _Replica) -> bool:
        try:
            resp = await self.http.get(r.url + "/health", timeout=max(0.2, self.config.probe_interval_s))
            return resp.status_code == 200
        except httpx.HTTPError:
            return False

    async def search(self, vector: list[float], top_k: int | None = None) -> Retrieved:
        cfg = self.config
        k = top_k or cfg.top_k
        body = {"vectors": [vector], "top_k": k, **cfg.search}
        tasks = [asyncio.create_task(self._shard(i, body)) for i in range(len(self.shards))]
        done, pending = await asyncio.wait(tasks, timeout=cfg.budget_ms / 1000)
        for t in pending:
            t.cancel()
        hits: dict[str, Hit] = {}
        missed = []
        for i, t in enumerate(tasks):
            if t not in done or t.exception() is not None:
                missed.append(i)
                continue
            for h in t.result():
                if h.id not in hits or hits[h.id].score < h.score:
                    hits[h.id] = h
        if self.metrics is not None:
            self.metrics.retrieval_queries.labels(cfg.name, "partial" if missed else "whole").inc()
        best = sorted(hits.values(), key=lambda h: -h.score)[:k]
        return Retrieved(best, missed)

    async def _shard(self, index: int, body: dict) -> list[Hit]:
        """The shard's hits from the first of its replicas to answer: hedged when the first is slow,
        the next asked at once when one fails."""
        cfg = self.config
        now = time.monotonic()
        order = sorted(self.shards[index], key=lambda r: (r.down_until > now, r.latency_s))
        running: dict[asyncio.Task, _Replica] = {}
        started: dict[_Replica, float] = {}

        def ask(r: _Replica) -> None:
            started[r] = time.monotonic()
            running[asyncio.create_task(self._ask(r, body))] = r

        ask(order.pop(0))
        hedge_s = cfg.hedge_ms / 1000 if cfg.hedge_ms > 0 else None
        try:
            while running:
                wait = hedge_s if order and hedge_s is not None else None
                done, _ = await asyncio.wait(running, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if not done:  # slow: the same query to the next replica too
                    self._count("hedges")
                    ask(order.pop(0))
                    hedge_s = None  # one hedge a query
                    continue
                for t in done:
                    r = running.pop(t)
                    if t.exception() is None:
                        self._observe(index, r)
                        for loser in running.values():  # slower than this, at least: asked later
                            loser.observe(time.monotonic() - started[loser])
                        return t.result()
                    r.down_until = time.monotonic() + cfg.down_s
                    if order:
                        self._count("failovers")
                        ask(order.pop(0))
            raise ShardFailed(f"every replica of shard {index} failed")
        finally:
            for t in running:
                t.cancel()

    async def _ask(self, r: _Replica, body: dict) -> list[Hit]:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        t0 = time.monotonic()
        resp = await self.http.post(r.url + "/search", json=body, headers=headers)
        if resp.status_code != 200:
            raise ShardFailed(f"{r.url}: HTTP {resp.status_code}")
        r.last_seconds = time.monotonic() - t0
        r.observe(r.last_seconds)
        (row,) = resp.json()["results"]
        return [Hit(h["id"], h["score"], h.get("text"), h.get("metadata") or {}) for h in row]

    def _observe(self, index: int, r: _Replica) -> None:
        if self.metrics is not None:
            self.metrics.retrieval_shard_seconds.labels(self.config.name, str(index)).observe(r.last_seconds)

    def _count(self, what: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, f"retrieval_{what}").labels(self.config.name).inc()
