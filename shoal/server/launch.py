"""`shoal serve`: the HTTP server comes up at once, the model loads behind it, /ready says when."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass

import uvicorn

from shoal.engine.async_engine import AsyncEngine, AsyncEngineConfig
from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.server.app import ServerState, build_app
from shoal.server.common import ServingContext
from shoal.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "warning"
    front: AsyncEngineConfig | None = None


def load_serving_context(engine_config: EngineConfig, server_config: ServerConfig) -> ServingContext:
    engine = LLMEngine(engine_config)
    front = AsyncEngine(engine, server_config.front).start()
    name = server_config.served_model_name or engine.model_name
    return ServingContext(
        engine=front,
        tokenizer=engine.tokenizer,
        model_name=name,
        max_model_len=engine.max_model_len,
        metrics=ServerMetrics(name, front.stats),
    )


def create_server(
    engine_config: EngineConfig, server_config: ServerConfig
) -> tuple[uvicorn.Server, ServerState]:
    state = ServerState(api_key=server_config.api_key, started=time.time())
    url = f"http://{server_config.host}:{server_config.port}"

    def load():
        t0 = time.monotonic()
        try:
            state.ctx = load_serving_context(engine_config, server_config)
        except Exception as exc:
            log.exception("model load failed")
            state.load_error = f"{type(exc).__name__}: {exc}"
            print(f"shoal: failed to load the model: {state.load_error}", file=sys.stderr, flush=True)
            return
        print(
            f"shoal: serving {state.ctx.model_name} at {url}/v1 (ready in {time.monotonic() - t0:.1f} s)",
            flush=True,
        )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loader = threading.Thread(target=load, name="shoal-load", daemon=True)
        loader.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loader.join)
            if state.ctx is not None:
                await asyncio.to_thread(state.ctx.engine.shutdown)

    app = build_app(state, lifespan)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config), state


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    server, _ = create_server(engine_config, server_config)
    print(
        f"shoal: loading the model; the API will be at http://{server_config.host}:{server_config.port}/v1",
        flush=True,
    )
    server.run()
