"""Real fleets for the gateway tests: `shoal fleet up` and extra `shoal gateway` processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx

from tests.server_helpers import ServerProcess, free_port

# A prompt holding this crashes the engine of a replica started with SHOAL_FAULT_CRASH_ON set to
# it (shoal.engine.faults); the shared fleet's replicas are.
POISON_MARKER = "ZZPOISONZZ"
FLEET_KEY = "sk-fleet-test"  # the shared fleet's API key (conftest), which its replicas require too


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def spawn(args: list[str], env: dict[str, str] | None = None, port: int | None = None) -> ServerProcess:
    port = port or free_port()
    fd, log_path = tempfile.mkstemp(prefix="shoal-gw-", suffix=".log")
    cmd = [sys.executable, "-m", "shoal.cli", *args, "--port", str(port)]
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    return ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)


def start_redis() -> tuple[subprocess.Popen, str]:
    """A redis-server of its own on 127.0.0.1 (Debian's package), no persistence: (process, URL)."""
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 10
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout != b"PONG\n":
        assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def stop_redis(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def wait_replicas_ready(
    gw: ServerProcess, count: int, timeout: float = 240.0, api_key: str | None = None
) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gw.proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {gw.log()}")
        try:
            reps = gw.http.get(gw.url + "/replicas", timeout=2, headers=auth(api_key)).json()["replicas"]
            # Routable: its probes say ready, and the controller has taken it into traffic (a
            # replica is ready by probe a moment before its fleet promotes it from "starting").
            if sum(r["state"] == "ready" and r.get("lifecycle", "ready") == "ready" for r in reps) >= count:
                return reps
        except (httpx.HTTPError, KeyError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"replicas not ready: {gw.log()}")


def start_fleet(
    replicas: int, *args: str, api_key: str | None = None, env: dict[str, str] | None = None
) -> ServerProcess:
    key_args = ["--api-key", api_key] if api_key else []
    gw = spawn(["fleet", "up", "--replicas", str(replicas), "--base-port", "0", *key_args, *args], env)
    try:
        wait_replicas_ready(gw, replicas, api_key=api_key)
    except BaseException:
        gw.stop()
        raise
    return gw


def start_gateway(backends: list[str], *args: str, api_key: str | None = None) -> ServerProcess:
    flags = [f for url in backends for f in ("--backend", url)]
    gw = spawn(["gateway", *flags, *(["--api-key", api_key] if api_key else []), *args])
    try:
        wait_replicas_ready(gw, len(backends), api_key=api_key)
    except BaseException:
        gw.stop()
        raise
    return gw


def replicas(gw: ServerProcess, api_key: str | None = None) -> dict[str, dict]:
    return {r["name"]: r for r in gw.get("/replicas", headers=auth(api_key)).json()["replicas"]}


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples on a /metrics page: every label set of a bare name, or those whose
    labels begin as given (`'name{a="b"'`)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and ("{" in name or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(gw: ServerProcess, cond, timeout: float, every: float = 0.1):
    """Until cond() holds (errors while the gateway comes up count as not yet), or fails with its
    log: what cond() gave."""
    deadline = time.monotonic() + timeout
    while True:
        assert gw.proc.poll() is None, gw.log()
        try:
            if held := cond():
                return held
        except (httpx.HTTPError, KeyError):
            pass
        assert time.monotonic() < deadline, f"timed out; {gw.log()[-3000:]}"
        time.sleep(every)
