"""Local replicas: `shoal serve` processes on loopback ports, restarted when they die."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from shoal.fleet.config import FleetConfig
from shoal.fleet.registry import Registry

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalReplica:
    name: str
    port: int
    log_path: str
    proc: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class LocalLauncher:
    def __init__(self, config: FleetConfig):
        self.config = config
        self.log_dir = tempfile.mkdtemp(prefix="shoal-fleet-")
        self.replicas: list[LocalReplica] = []
        for i in range(config.replicas):
            port = config.base_port + i if config.base_port else free_port()
            self.replicas.append(
                LocalReplica(f"replica-{i}", port, os.path.join(self.log_dir, f"replica-{i}.log"))
            )
        self._task: asyncio.Task | None = None
        self.registry: Registry | None = None

    def _spawn(self, r: LocalReplica) -> None:
        cfg = self.config
        cmd = [sys.executable, "-m", "shoal.cli", "serve", "--port", str(r.port), *cfg.replica_args]
        if cfg.model:
            cmd.insert(4, cfg.model)
        if cfg.gateway.replica_key:
            cmd += ["--api-key", cfg.gateway.replica_key]
        with open(r.log_path, "a") as out:
            r.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.registry.add(r.name, r.url, r.proc.pid)

    async def start(self, registry: Registry) -> None:
        self.registry = registry
        for r in self.replicas:
            self._spawn(r)
        self._task = asyncio.create_task(self._supervise())

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            for r in self.replicas:
                if r.proc is not None and r.proc.poll() is not None:
                    code = r.proc.returncode
                    log.warning("%s exited with %s; restarting", r.name, code)
                    self.registry.mark_down(r.name, f"process exited with {code}")
                    r.proc = None
                    r.restarts += 1
                    await asyncio.sleep(self.config.restart_backoff_s)
                    self._spawn(r)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()
        for r in self.replicas:
            if r.proc is not None:
                try:
                    await asyncio.to_thread(r.proc.wait, 15)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
