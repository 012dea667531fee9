"""Real fleets for the gateway tests: `shoal fleet up` and extra `shoal gateway` processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx

from tests.server_helpers import ServerProcess, free_port


def _spawn(args: list[str]) -> ServerProcess:
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="shoal-gw-", suffix=".log")
    cmd = [sys.executable, "-m", "shoal.cli", *args, "--port", str(port)]
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    return ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)


def wait_replicas_ready(gw: ServerProcess, count: int, timeout: float = 240.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gw.proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {gw.log()}")
        try:
            reps = httpx.get(gw.url + "/replicas", timeout=2).json()["replicas"]
            if sum(r["state"] == "ready" for r in reps) >= count:
                return reps
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"replicas not ready: {gw.log()}")


def start_fleet(replicas: int, *args: str) -> ServerProcess:
    gw = _spawn(["fleet", "up", "--replicas", str(replicas), "--base-port", "0", *args])
    wait_replicas_ready(gw, replicas)
    return gw


def start_gateway(backends: list[str], *args: str) -> ServerProcess:
    flags = [f for url in backends for f in ("--backend", url)]
    gw = _spawn(["gateway", *flags, *args])
    wait_replicas_ready(gw, len(backends))
    return gw


def replicas(gw: ServerProcess) -> dict[str, dict]:
    return {r["name"]: r for r in gw.get("/replicas").json()["replicas"]}


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) on a /metrics page."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total
