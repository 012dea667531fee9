"""A replica process this gateway did not start: one its fleet's earlier leader started on this
host, found again by its pid and its start time (a pid alone may have been reused since)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from shoal.fleet.control.cores import CoreLease

GONE = -1  # its exit code is its parent's to read, not ours


def host_id() -> str:
    """This host, as a process table sees it: its name and this boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


def process_start(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), None if there is no such live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped (its new parent may never reap it)
        return None
    return int(fields[19])


class AdoptedProcess:
    """The launcher's handle (see base.ReplicaProcess) of a process we are not the parent of."""

    node = None  # this host

    def __init__(self, pid: int, started: int, address: tuple[str, int], lease: CoreLease | None = None):
        self.pid = pid
        self.started = started
        self.address = address
        self.lease = lease
        self.cpus = lease.cpus if lease is not None else None

    def _alive(self) -> bool:
        return process_start(self.pid) == self.started

    def poll(self) -> int | None:
        if self._alive():
            return None
        if self.lease is not None:
            self.lease.release()
        return GONE

    def _signal(self, sig: int) -> None:
        if self._alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return GONE
