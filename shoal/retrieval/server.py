"""`shoal index serve`: one index shard behind HTTP, loaded from its folder at start.

POST /search takes unit-normalized query vectors and answers each one's nearest documents;
/health, /ready, /info and /metrics are what a router and a scrape need. A recall probe (every
`recall_probe_interval_s`) searches a few stored vectors both ways, through the index and by brute
force, and exports the index's recall@10."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from shoal.protocol import tracing
from shoal.protocol.auth import bearer_matches
from shoal.protocol.bodies import parse_json_object
from shoal.protocol.errors import APIError, install_error_handlers, validation_message
from shoal.retrieval.shard import IndexShard, SearchParams

log = logging.getLogger(__name__)

# Fault injection for tests and benchmarks: searches answer this much later (a slow replica), all
# of them or the given share of them (a replica with hiccups: a noisy neighbour, a paging host).
SEARCH_DELAY_ENV = "SHOAL_FAULT_SEARCH_DELAY_S"
SEARCH_DELAY_SHARE_ENV = "SHOAL_FAULT_SEARCH_DELAY_SHARE"
MAX_QUERIES = 256
PROBE_QUERIES = 16


@dataclass
class IndexServerConfig:
    folder: str = "."
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str | None = None
    recall_probe_interval_s: float = 0.0  # 0: no probes
    log_level: str = "warning"


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    vectors: Annotated[list[list[float]], Field(min_length=1, max_length=MAX_QUERIES)]
    top_k: Annotated[StrictInt, Field(ge=1, le=1000)] = 10
    nprobe: Annotated[StrictInt, Field(ge=1, le=65536)] | None = None
    ef_search: Annotated[StrictInt, Field(ge=1, le=65536)] | None = None
    k_factor: Annotated[StrictInt, Field(ge=1, le=1024)] | None = None

    def params(self) -> SearchParams:
        given = {k: getattr(self, k) for k in ("nprobe", "ef_search", "k_factor") if getattr(self, k)}
        return SearchParams(**given)


class ShardMetrics:
    def __init__(self, shard: IndexShard):
        self.registry = CollectorRegistry()
        labels = {"shard": shard.name}
        self.seconds = Histogram(
            "shoal:index_search_seconds",
            "Time to search a batch of queries.",
            ["shard"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
        ).labels(**labels)
        self.queries = Counter(
            "shoal:index_queries", "Queries searched.", ["shard"], registry=self.registry
        ).labels(**labels)
        Gauge("shoal:index_vectors", "Vectors in the shard.", ["shard"], registry=self.registry).labels(
            **labels
        ).set(shard.count)
        self.recall = Gauge(
            "shoal:index_recall_at_10",
            "Recall@10 of the index against brute force, from the last recall probe.",
            ["shard"],
            registry=self.registry,
        ).labels(**labels)


def build_index_app(shard: IndexShard, config: IndexServerConfig) -> FastAPI:
    metrics = ShardMetrics(shard)
    delay = float(os.environ.get(SEARCH_DELAY_ENV) or 0)
    delay_share = float(os.environ.get(SEARCH_DELAY_SHARE_ENV) or 1)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        probe = None
        if config.recall_probe_interval_s > 0 and shard.vectors_path is not None:
            probe = asyncio.create_task(_probe_recall(shard, metrics, config.recall_probe_interval_s))
        yield
        if probe is not None:
            probe.cancel()

    app = FastAPI(title="shoal index shard", lifespan=lifespan, **tracing.fastapi_options())
    install_error_handlers(app)

    def check_key(raw: Request) -> None:
        if config.api_key and not bearer_matches(raw.headers.get("authorization") or "", config.api_key):
            raise APIError(401, "a valid API key is required", code="invalid_api_key")

    @app.get("/health")
    @app.get("/ready")
    async def health():
        return {"status": "ok"}

    @app.get("/info")
    async def info(raw: Request):
        check_key(raw)
        spec = asdict(shard.spec)
        return {"name": shard.name, "count": shard.count, "dim": shard.dim, "spec": spec}

    @app.post("/search")
    async def search(raw: Request):
        check_key(raw)
        try:
            req = SearchRequest.model_validate(parse_json_object(await raw.body()))
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise APIError(400, message, param) from None
        if any(len(v) != shard.dim for v in req.vectors):
            raise APIError(400, f"query vectors must have {shard.dim} components", "vectors")
        queries = np.asarray(req.vectors, dtype=np.float32)
        if not np.all(np.linalg.norm(queries, axis=1) > 0):
            raise APIError(400, "a query vector is all zeros", "vectors")
        t0 = time.perf_counter()
        if delay and random.random() < delay_share:
            await asyncio.sleep(delay)
        hits = await asyncio.to_thread(shard.search, queries, req.top_k, req.params())
        metrics.seconds.observe(time.perf_counter() - t0)
        metrics.queries.inc(len(queries))
        return {"shard": shard.name, "results": [[asdict(h) for h in row] for row in hits]}

    @app.get("/metrics")
    async def scrape():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _probe_recall(shard: IndexShard, metrics: ShardMetrics, every_s: float) -> None:
    """Recall@10 of stored vectors searched through the index, against brute force."""
    while True:
        try:
            rows = random.sample(range(shard.count), min(PROBE_QUERIES, shard.count))
            stored = np.load(shard.vectors_path, mmap_mode="r")
            queries = np.asarray(stored[sorted(rows)])
            found = await asyncio.to_thread(shard.search, queries, 10)
            exact = await asyncio.to_thread(shard.exact, queries, 10)
            hit = sum(len({h.id for h in f} & set(e)) for f, e in zip(found, exact))
            metrics.recall.set(hit / max(1, sum(len(e) for e in exact)))
        except Exception:  # a probe that fails says nothing; the shard goes on serving
            log.exception("recall probe failed")
        await asyncio.sleep(every_s)


def serve_index(config: IndexServerConfig) -> int:
    import uvicorn

    shard = IndexShard.load(Path(config.folder))
    log.warning("shard %s: %d vectors of width %d (%s)", shard.name, shard.count, shard.dim, shard.spec.kind)
    app = build_index_app(shard, config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    return 0
