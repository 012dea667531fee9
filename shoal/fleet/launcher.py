"""Local replicas: `shoal serve` processes on loopback ports, restarted when they die.

Crash safety. Replicas die with their supervisor, however it dies: each child asks the kernel for
SIGKILL when its parent goes (Linux, prctl PR_SET_PDEATHSIG), and is told its parent's pid
(SHOAL_PARENT_PID) so that `shoal serve` can exit by itself where there is no prctl. A port that is
already taken is never started on: whatever holds it (an orphan of an earlier fleet, a stranger)
would answer the probes as if it were ours. Restarts back off exponentially, and a replica that
stayed up a while starts again from the shortest backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from shoal.fleet.config import FleetConfig
from shoal.fleet.registry import Registry
from shoal.protocol.kv_files import shm_sweep
from shoal.protocol.secrets import KV_SALT_ENV, KV_TRANSFER_KEY_ENV

log = logging.getLogger(__name__)

PARENT_PID_ENV = "SHOAL_PARENT_PID"  # read by `shoal serve`
PR_SET_PDEATHSIG = 1
SUPERVISE_INTERVAL_S = 0.1
PORT_RECHECK_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether binding `port` would fail (SO_REUSEADDR as servers set it: a socket in TIME_WAIT
    does not count, a listening one does)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _die_with_parent():
    """A preexec_fn that makes the child get SIGKILL when the thread that spawned it exits (so
    spawn only from a thread that lives as long as the supervisor: the event loop's)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return preexec


@dataclass
class LocalReplica:
    name: str
    port: int
    log_path: str
    role: str = "both"
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    quick_deaths: int = 0  # deaths in a row, each before it had stayed up restart_reset_after_s
    next_start: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class LocalLauncher:
    def __init__(self, config: FleetConfig):
        self.config = config
        gw = config.gateway
        # One salt per fleet, shared by its replicas (through the environment: argv is public)
        # and its gateway, so that the router's block hashes are the replicas' own.
        if not gw.kv_salt:
            gw.kv_salt = os.environ.get(KV_SALT_ENV) or secrets.token_hex(16)
        if not gw.kv_transfer_key:  # likewise the key of K/V handoffs between its workers
            gw.kv_transfer_key = secrets.token_hex(16)
        self.log_dir = tempfile.mkdtemp(prefix="shoal-fleet-")
        self.replicas: list[LocalReplica] = []
        for i, role in enumerate(config.roles()):
            port = config.base_port + i if config.base_port else free_port()
            name = f"{role}-{i}" if role != "both" else f"replica-{i}"
            self.replicas.append(LocalReplica(name, port, os.path.join(self.log_dir, f"{name}.log"), role))
        self._task: asyncio.Task | None = None
        self.registry: Registry | None = None

    def busy_ports(self) -> list[int]:
        return [r.port for r in self.replicas if port_in_use(r.port)]

    def _command(self, r: LocalReplica) -> list[str]:
        cfg = self.config
        cmd = [sys.executable, "-m", "shoal.cli", "serve", "--port", str(r.port), *cfg.replica_args]
        if cfg.model:
            cmd.insert(4, cfg.model)
        if cfg.gateway.replica_key:
            cmd += ["--api-key", cfg.gateway.replica_key]
        if r.role != "both":
            cmd += ["--role", r.role]
        return cmd

    def _start(self, r: LocalReplica) -> bool:
        """Starts `r` unless its port is taken (then it shows as port_in_use until it is free)."""
        if port_in_use(r.port):
            rep = self.registry.replicas.get(r.name)
            if rep is None or rep.state != "port_in_use":
                log.warning("%s: port %d is in use by another process; not starting it", r.name, r.port)
            self.registry.port_in_use(
                r.name, f"port {r.port} is in use by another process; {r.name} waits for it to be free"
            )
            return False
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            KV_SALT_ENV: self.config.gateway.kv_salt,
            KV_TRANSFER_KEY_ENV: self.config.gateway.kv_transfer_key,
            PARENT_PID_ENV: str(os.getpid()),
        }
        with open(r.log_path, "a") as out:
            r.proc = subprocess.Popen(
                self._command(r),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which stops them
                preexec_fn=_die_with_parent(),  # only prctl runs between fork and exec
            )
        r.started_at = time.monotonic()
        rep = self.registry.add(r.name, r.url, r.proc.pid, r.proc.poll)
        rep.restarts, rep.role = r.restarts, r.role
        return True

    async def start(self, registry: Registry) -> None:
        """Called on the event loop's thread, which spawns every replica (see _die_with_parent)."""
        self.registry = registry
        for r in self.replicas:
            registry.add(r.name, r.url).role = r.role
            self._start(r)
        self._task = asyncio.create_task(self._supervise())

    def _backoff(self, r: LocalReplica, now: float) -> float:
        cfg = self.config
        if now - r.started_at >= cfg.restart_reset_after_s:
            r.quick_deaths = 0
        delay = min(cfg.restart_backoff_max_s, cfg.restart_backoff_s * 2**r.quick_deaths)
        r.quick_deaths += 1
        return delay

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            for r in self.replicas:
                try:
                    self._tend(r, time.monotonic())
                except Exception:  # the supervisor must outlive any one replica's trouble
                    log.exception("%s: supervision failed; retrying", r.name)
                    r.next_start = time.monotonic() + self._backoff(r, time.monotonic())

    def _tend(self, r: LocalReplica, now: float) -> None:
        if r.proc is not None:
            code = r.proc.poll()
            if code is None:
                return
            self.registry.mark_down(r.name, f"process exited with {code}", code)
            shm_sweep(r.proc.pid)  # K/V it was handing over when it died
            r.proc = None
            r.restarts += 1
            delay = self._backoff(r, now)
            r.next_start = now + delay
            log.warning("%s exited with %s; restarting in %.1f s", r.name, code, delay)
        elif now >= r.next_start and not self._start(r):
            r.next_start = now + PORT_RECHECK_S

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
