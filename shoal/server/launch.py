"""`shoal serve`: the HTTP server comes up at once, the model loads behind it, /ready says when."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, replace

import uvicorn

from shoal.engine.async_engine import AsyncEngine, AsyncEngineConfig
from shoal.engine.config import EngineConfig
from shoal.engine.core import EngineCore
from shoal.engine.parallel.executor import ExecutorDeadError
from shoal.models.config import ModelConfig
from shoal.models.tool_formats import tool_format
from shoal.protocol import tracing
from shoal.protocol.bodies import DEFAULT_MAX_BODY_BYTES
from shoal.protocol.bounds import check_bounds
from shoal.protocol.errors import EXIT_ENGINE_DEAD, EXIT_RANK_LOST
from shoal.protocol.secrets import kv_salt
from shoal.protocol.supervision import LIFELINE_ENV, PARENT_PID_ENV
from shoal.server.app import ServerState, build_app
from shoal.server.common import ServingContext
from shoal.server.drain import Drain, DrainingServer
from shoal.server.kv_connector import KVConnector, KVConnectorConfig
from shoal.server.metrics import ServerMetrics

WATCH_INTERVAL_S = 0.5

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "warning"
    front: AsyncEngineConfig | None = None
    max_request_bytes: int = DEFAULT_MAX_BODY_BYTES
    trust_request_priority: bool = False
    kv_salt: str | None = None
    tool_call_parser: str = "auto"  # see models.tool_formats
    embedding_pooling: str = "auto"  # /v1/embeddings: "mean", "last", or auto (the checkpoint's, else last)
    kv: KVConnectorConfig = field(default_factory=KVConnectorConfig)  # role and K/V handoff
    # Data a client's connection leaves unacknowledged this long means its link is gone (a host cut
    # off): the connection drops and its requests are aborted, not run on for nobody.
    peer_timeout_s: float = 5.0
    # SIGTERM: new requests are refused, those in flight get this long to finish (see drain.py).
    shutdown_timeout_s: float = 30.0
    # OpenTelemetry spans go here over OTLP/HTTP (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT).
    otlp_traces_endpoint: str | None = None

    def __post_init__(self):
        least = {"port": 0, "max_request_bytes": 1, "peer_timeout_s": 0, "shutdown_timeout_s": 0}
        check_bounds(self, least, most={"port": 65535})


def load_serving_context(engine_config: EngineConfig, server_config: ServerConfig) -> ServingContext:
    salt = kv_salt(server_config.kv_salt, server_config.api_key)
    engine = EngineCore(replace(engine_config, cache=replace(engine_config.cache, hash_salt=salt)))
    kv = server_config.kv
    front_config = replace(server_config.front or AsyncEngineConfig(), kv_hold_timeout_s=kv.hold_timeout_s)
    front = AsyncEngine(engine, front_config).start()
    name = server_config.served_model_name or engine.model_name
    metrics = ServerMetrics(name, front.stats)
    return ServingContext(
        engine=front,
        tokenizer=engine.tokenizer,
        model_name=name,
        max_model_len=engine.max_model_len,
        metrics=metrics,
        trust_request_priority=server_config.trust_request_priority,
        tool_format=tool_format(server_config.tool_call_parser, engine.tokenizer.chat_template),
        kv=KVConnector(kv, front, metrics.registry, server_config.api_key),
        adapters=None if engine.lora is None else {n: a.path for n, a in engine.lora.adapters.items()},
        pooling=_pooling(server_config.embedding_pooling, engine.loaded.config),
        embedding_width=engine.loaded.config.hidden_size,
    )


def _pooling(flag: str, model: ModelConfig) -> str:
    if flag != "auto":
        return flag
    return model.pooling or "last"  # a causal model's last position has seen all


def create_server(
    engine_config: EngineConfig, server_config: ServerConfig
) -> tuple[uvicorn.Server, ServerState]:
    state = ServerState(
        api_key=server_config.api_key,
        started=time.time(),
        max_request_bytes=server_config.max_request_bytes,
        role=server_config.kv.role,
        drain=Drain(server_config.shutdown_timeout_s),
    )
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

    server: uvicorn.Server | None = None

    def stop(reason: str, code: int) -> None:
        print(f"shoal: {reason}; exiting", file=sys.stderr, flush=True)
        state.exit_code = code
        if server is not None:
            server.should_exit = True

    async def watch() -> None:
        """A dead engine loop exits the process, so that its supervisor restarts it instead of
        probing a 503 forever; so does the death of a supervisor that asked for it, or (a fleet of
        several gateways) the silence of every gateway for the lifeline's length."""
        parent = os.environ.get(PARENT_PID_ENV)
        lifeline = float(os.environ.get(LIFELINE_ENV) or 0)
        state.gateway_seen = time.monotonic()  # listening from now: the first probe is due
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if state.ctx is not None and not state.ctx.engine.is_alive:
                error = state.ctx.engine.error
                code = EXIT_RANK_LOST if isinstance(error, ExecutorDeadError) else EXIT_ENGINE_DEAD
                return stop(f"the engine loop died ({error!r})", code)
            if parent and os.getppid() != int(parent):
                return stop(f"the supervisor (pid {parent}) is gone", 0)
            if lifeline and time.monotonic() - state.gateway_seen > lifeline:
                return stop(f"no gateway has probed it for {lifeline:g} s: the fleet is gone", 0)

    def held() -> int:
        return state.ctx.engine.load().get("kv_held", 0) if state.ctx is not None else 0

    async def drain() -> None:
        """A drain ends in an exit, once its requests are done or its time is up."""
        if not await state.drain.wait(held):
            server.config.timeout_graceful_shutdown = 1  # what is left is cut off
        server.should_exit = True

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loader = threading.Thread(target=load, name="shoal-load", daemon=True)
        loader.start()
        watchers = [asyncio.create_task(watch()), asyncio.create_task(drain())]
        try:
            yield
        finally:
            for watcher in watchers:
                watcher.cancel()
            await asyncio.to_thread(loader.join)
            if state.ctx is not None:
                await state.ctx.kv.close()
                await asyncio.to_thread(state.ctx.engine.shutdown)

    app = build_app(state, lifespan)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, state.drain.begin)
    return server, state


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Runs until stopped; the exit status says why (EXIT_ENGINE_DEAD: restart me)."""
    server, state = create_server(engine_config, server_config)
    endpoint = tracing.endpoint_from(server_config.otlp_traces_endpoint)
    tracing.configure("shoal-serve", endpoint, **{"shoal.role": server_config.kv.role})
    print(
        f"shoal: loading the model; the API will be at http://{server_config.host}:{server_config.port}/v1",
        flush=True,
    )
    try:
        server.run(sockets=[listen_socket(server_config)])
    finally:
        tracing.shutdown()
    return state.exit_code


def listen_socket(config: ServerConfig) -> socket.socket:
    """The API's socket. Its connections inherit TCP_USER_TIMEOUT (Linux): while a partitioned
    client's link carries nothing, a stream would go on until its request finished, since TCP
    retransmits for many minutes before it gives up; a gateway meanwhile continues it elsewhere."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    try:
        sock = socket.create_server((config.host, config.port), family=family, backlog=2048)
    except OSError as exc:
        raise OSError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    if config.peer_timeout_s > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(config.peer_timeout_s * 1000))
    return sock
