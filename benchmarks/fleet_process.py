"""A `shoal fleet up` process for the benchmarks: started on free ports, waited for, stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx

from shoal.fleet.control.launchers.local import free_port


def stop_process(proc: subprocess.Popen) -> None:
    """Asks a server to exit, and kills it after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


class FleetProcess:
    def __init__(self, args: list[str], replica_args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="shoal-bench-fleet-", suffix=".log")
        cmd = [sys.executable, "-m", "shoal.cli", "fleet", "up", "--port", str(self.port), "--base-port", "0"]
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(
                [*cmd, *args, "--replica-args", replica_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )

    def wait_ready(self, count: int, timeout: float = 300) -> list[dict]:
        """The replicas, once `count` of them take traffic."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fleet exited; see {self.log_path}")
            try:
                reps = httpx.get(self.url + "/replicas", timeout=2).json()["replicas"]
                if sum(r["lifecycle"] == "ready" and r["state"] == "ready" for r in reps) >= count:
                    return reps
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"fleet not ready; see {self.log_path}")

    def stop(self) -> None:
        stop_process(self.proc)


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) on a /metrics page."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total
