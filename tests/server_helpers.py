"""Real `shoal serve` processes on 127.0.0.1 for the server tests, and stand-in replicas (small
HTTP servers of the test's own) for the gateway tests that need a replica to misbehave on cue."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI

from shoal.fleet.control.launchers.local import port_in_use


def free_port() -> int:
    """A port free now, at random below the kernel's ephemeral range: the kernel hands a port it
    chose out again as soon as it is free (289 repeats in 3000 picks here), so a test's port taken
    that way could go to the next server started, or to a fleet's replica, before its own server
    had bound it. Ports chosen here never meet the kernel's, and two rarely meet each other."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        ephemeral_low = int(ranges.read().split()[0])
    while True:
        port = random.randrange(max(1024, ephemeral_low - 16384), ephemeral_low)
        if not port_in_use(port):
            return port


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: str
    api_key: str | None = None  # sent on the internal routes this helper reads (/load)
    # One client for the test's calls, as an SDK keeps one: httpx.get builds a client and its TLS
    # context per call (50 ms of CPU here), a sixth to a half of a core at a poll's pace, taken
    # from the servers under test on this 2-core host (3 % of two fleet modules' time).
    http: httpx.Client = field(default_factory=httpx.Client, repr=False, compare=False)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def get(self, path: str, **kw) -> httpx.Response:
        if self.api_key and "headers" not in kw:
            kw["headers"] = {"Authorization": f"Bearer {self.api_key}"}
        return self.http.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.http.post(self.url + path, timeout=60, **kw)

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Waits until no request runs or waits and every KV block is free again; returns /load."""
        deadline = time.monotonic() + timeout
        while True:
            load = self.get("/load").json()
            if load["running"] == 0 and load["waiting"] == 0 and load["free_blocks"] == load["num_blocks"]:
                return load
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {load}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(*args: str, timeout: float = 180.0, env: dict[str, str] | None = None) -> ServerProcess:
    (server,) = start_servers(list(args), timeout=timeout, env=env)
    return server


def start_servers(
    *arg_lists: list[str], timeout: float = 180.0, env: dict[str, str] | None = None
) -> list[ServerProcess]:
    """`shoal serve` with each list of arguments, all started at once and then waited for (each
    start is mostly one core's work); if one fails, all are stopped."""
    servers = [_spawn_server(args, env) for args in arg_lists]
    try:
        for server in servers:
            wait_ready(server, timeout)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def _spawn_server(args: list[str], env: dict[str, str] | None) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--port", str(port), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    fd, log_path = tempfile.mkstemp(prefix="shoal-serve-", suffix=".log")
    with os.fdopen(fd, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    return ServerProcess(f"http://127.0.0.1:{port}", proc, log_path, key)


def wait_ready(server: ServerProcess, timeout: float) -> None:
    """Until the server's /ready says 200; raises if its process exits, TimeoutError past `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.url} exited with {server.proc.returncode}: {server.log()[-3000:]}")
        try:
            if server.http.get(server.url + "/ready", timeout=2).status_code == 200:
                return
            health = server.http.get(server.url + "/health", timeout=2)
            if health.status_code == 503 and health.json().get("status") == "failed":
                raise RuntimeError(f"{server.url} failed to load: {health.json().get('reason')}")
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{server.url} did not become ready: {server.log()[-3000:]}")


async def stream_gaps(client: httpx.AsyncClient, url: str, body: dict, gaps: list[float], **kw) -> None:
    """Streams `body` to `url` (stream on), appending each gap between two SSE events to `gaps`."""
    last = None
    async with client.stream("POST", url, json={**body, "stream": True}, **kw) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now


@contextlib.contextmanager
def raw_post(url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> Iterator[None]:
    """A POST sent on a bare socket and left unread: the client leaves when the block ends (an
    HTTP library would read or pool the connection instead of just closing it)."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    head = {"Host": host, "Content-Type": "application/json", "Content-Length": str(len(data))}
    head.update(headers or {})
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\n".encode())
        sock.sendall("".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n" + data)
        yield


def sse_objects(resp: httpx.Response) -> Iterator[dict]:
    """The JSON events of a streamed (SSE) response, in order, up to [DONE]."""
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def stand_in_app() -> FastAPI:
    """A stand-in replica's app: healthy and ready; the test adds the routes that misbehave."""
    app = FastAPI()

    @app.get("/health")
    @app.get("/ready")
    async def fine():
        return {"status": "ok"}

    return app


class StandIn:
    """`app` served by uvicorn on 127.0.0.1, in a thread of the test process."""

    def __init__(self, app: FastAPI):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)

    def __enter__(self) -> StandIn:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
