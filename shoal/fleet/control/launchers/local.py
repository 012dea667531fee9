"""The local launcher: starts a replica as a `shoal serve` process on a loopback port. What to run
and when (restarts, scaling, draining) is the controller's (shoal.fleet.control.controller).

Crash safety. Replicas die with their supervisor, however it dies: each child asks the kernel for
SIGKILL when its parent goes (Linux, prctl PR_SET_PDEATHSIG), and is told its parent's pid
(SHOAL_PARENT_PID) so that `shoal serve` can exit by itself where there is no prctl. A fleet of
several gateways (a shared store) starts them detached instead, with a lifeline: they outlive the
gateway that started them, while any gateway of the fleet probes them, and exit once none has for
the lifeline's length (protocol/supervision.py). A port that is already taken is never started on:
whatever holds it (an orphan of an earlier fleet, a stranger) would answer the probes as if it
were ours.

Cores. Each replica gets its share of this host's cores from a CoreAllocator (shoal.fleet.control.cores):
it is pinned to them before it execs and runs as many compute threads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

from shoal.fleet.control.cores import CoreAllocator, CoreLease, CoresConfig, thread_env, threads_flag
from shoal.fleet.control.launchers.adopted import AdoptedProcess, host_id, process_start
from shoal.fleet.control.launchers.base import ReplicaSpec
from shoal.protocol.supervision import LIFELINE_ENV, PARENT_PID_ENV

PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_listener(host: str, port: int) -> socket.socket | None:
    """A TCP socket bound to `port` as servers bind (SO_REUSEADDR: a socket in TIME_WAIT does not
    stand in the way, a listening one does), or None when it is taken. Port 0: any free one."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether binding `port` would fail (see bind_listener)."""
    sock = bind_listener(host, port)
    if sock is None:
        return True
    sock.close()
    return False


def _die_with_parent(cpus: list[int] | None = None, detached: bool = False):
    """A preexec_fn that makes the child get SIGKILL when the thread that spawned it exits (so
    spawn only from a thread that lives as long as the supervisor: the event loop's), unless
    `detached`, and pins it to `cpus` before it starts a thread."""
    prctl = None
    if sys.platform.startswith("linux") and not detached:
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        except (OSError, AttributeError):
            prctl = None
    pin = cpus if cpus and hasattr(os, "sched_setaffinity") else None
    if prctl is None and pin is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        if pin is not None:
            os.sched_setaffinity(0, pin)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the request took effect
                os._exit(1)

    return preexec


class LocalProcess:
    """A started replica: its pid, whether it has exited, and how to stop it."""

    node = None  # this host

    def __init__(self, popen: subprocess.Popen, address: tuple[str, int], lease: CoreLease | None = None):
        self.popen = popen
        self.pid = popen.pid
        self.started = process_start(popen.pid)  # with the pid, what a next leader finds it by
        self.address = address  # (host, port) it listens on
        self.lease = lease
        self.cpus = lease.cpus if lease is not None else None  # the cores it is pinned to

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self.lease is not None:
            self.lease.release()  # its cores are free for the next replica
        return code

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def wait(self, timeout: float) -> int:
        code = self.popen.wait(timeout)
        self.poll()
        return code


class LocalLauncher:
    """Replicas as child processes of this one, on 127.0.0.1, each on its share of the cores;
    with a `lifeline` (seconds), detached: they outlive this process while a gateway probes them."""

    name = "local"
    host = "127.0.0.1"

    def __init__(self, cores: CoreAllocator | None = None, lifeline_s: float = 0.0):
        self.cores = cores or CoreAllocator.for_fleet(CoresConfig(), 1)
        self.lifeline_s = lifeline_s
        self._given: set[int] = set()  # free ports handed out: free again until their replica binds

    def has_room(self) -> bool:
        """Whether the cores take one more replica now (see CoresConfig.when_full)."""
        return self.cores.has_room()

    def port_in_use(self, port: int) -> bool:
        return port_in_use(port)

    def port_for(self, base_port: int, index: int) -> int:
        """The port of the index-th replica: base_port + index, or any free one (base_port 0) that
        no other replica of this launcher was given."""
        if base_port:
            return base_port + index
        port = free_port()
        while port in self._given:
            port = free_port()
        self._given.add(port)
        return port

    def shutdown(self) -> None:
        """Nothing to let go of: the processes are the controller's to stop."""

    def adopt(self, pid: int, started: int, host: str, address: tuple[str, int]) -> AdoptedProcess | None:
        """The replica an earlier leader of the fleet started as `pid` at `started` on `host`, if
        it still runs there and this is that host; it keeps the cores it is pinned to."""
        if host != host_id() or process_start(pid) != started:
            return None
        try:
            pinned = sorted(os.sched_getaffinity(pid))
        except (OSError, AttributeError):
            pinned = []
        lease = self.cores.hold(pinned) if pinned and set(pinned) < set(self.cores.cpus) else None
        return AdoptedProcess(pid, started, address, lease)

    def spawn(self, spec: ReplicaSpec) -> LocalProcess:
        """Called on the event loop's thread, which lives as long as the fleet (see _die_with_parent)."""
        cmd = [sys.executable, "-m", "shoal.cli", "serve", *([spec.model] if spec.model else [])]
        cmd += ["--port", str(spec.port), *spec.args]
        lease = self.cores.acquire(threads_flag(spec.args))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.lifeline_s:
            env[LIFELINE_ENV] = f"{self.lifeline_s:g}"
            env.pop(PARENT_PID_ENV, None)
        else:
            env[PARENT_PID_ENV] = str(os.getpid())
        env.update(thread_env(lease.threads, lease.shared), **spec.env)
        try:
            with open(spec.log_path, "a") as out:
                popen = subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which stops them
                    # only prctl and affinity between fork and exec
                    preexec_fn=_die_with_parent(lease.cpus, detached=bool(self.lifeline_s)),
                )
        except BaseException:
            lease.release()
            raise
        return LocalProcess(popen, (self.host, spec.port), lease)
