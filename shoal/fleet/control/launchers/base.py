"""What the controller asks of a launcher, and of the process handle it gets back. A launcher only
starts processes where it places them; what to run and when is the controller's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ReplicaSpec:
    """One replica process to start: what it serves, where, and with which secrets."""

    name: str
    port: int
    log_path: str
    model: str | None = None  # checkpoint (None: the bundled model)
    args: list[str] = field(default_factory=list)  # `shoal serve` flags
    env: dict[str, str] = field(default_factory=dict)  # secrets go here, never in argv
    memory_mb: float = 0.0  # what it takes (a remote launcher reserves it on the node it picks)


class ReplicaProcess(Protocol):
    """A started replica. Every call returns at once: the controller runs on the event loop."""

    pid: int | None
    node: str | None  # where a remote launcher placed it (None: this host)
    address: tuple[str, int] | None  # (host, port) it listens on, once known
    started: int | None  # on this host: when its process started (/proc clock ticks), else None

    def poll(self) -> int | None: ...  # its exit code, None while it runs

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float) -> int: ...  # blocks: call it on a worker thread


class Launcher(Protocol):
    name: str
    host: str  # where replicas listen until placed

    def port_in_use(self, port: int) -> bool: ...

    def port_for(self, base_port: int, index: int) -> int: ...

    def has_room(self) -> bool: ...  # whether one more replica may start now (free cores)

    def spawn(self, spec: ReplicaSpec) -> ReplicaProcess: ...

    # The replica the fleet's earlier leader started (None: gone, or not this launcher's to find).
    def adopt(self, pid: int, started: int, host: str, address: tuple[str, int]) -> ReplicaProcess | None: ...

    def shutdown(self) -> None: ...
