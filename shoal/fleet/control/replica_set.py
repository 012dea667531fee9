"""The fleet's replica set: each model's pools of replica slots and the lifecycle of each slot.

A slot is one replica's place in the fleet (its name and port), whatever process fills it now:
starting (its process loads the model), standby (loaded, takes no traffic until promoted), ready
(takes traffic), draining (takes no new traffic, finishes what it has), stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from shoal.fleet.config import ModelConfig
from shoal.fleet.control.autoscaler import Autoscaler


class Lifecycle(StrEnum):
    STARTING = "starting"
    STANDBY = "standby"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(eq=False)
class Slot:
    name: str
    pool: Pool
    port: int
    log_path: str
    host: str = "127.0.0.1"
    state: Lifecycle = Lifecycle.STARTING
    proc: object | None = None  # the launcher's handle: pid, poll(), terminate(), kill(), wait()
    restarts: int = 0
    started_at: float = 0.0  # when its current process was started
    quick_deaths: int = 0  # deaths in a row, each before it had stayed up restart_reset_after_s
    next_start: float = 0.0
    drain_since: float | None = None
    model: ModelConfig | None = None  # the version of the model config it runs
    version: int = 0
    surge: bool = False  # started beside the others by a rolling update
    attached: bool = False  # its process's address is known and in the registry

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(eq=False)
class Pool:
    """The replicas of one model in one role, and how many of them should take traffic."""

    model: ModelConfig
    role: str
    min: int
    max: int
    autoscaler: Autoscaler | None  # None: a fixed pool of `min` replicas
    slots: list[Slot] = field(default_factory=list)
    desired: int = 0  # active replicas wanted now
    decision: str = ""  # why, as the autoscaler last said
    raised_at: float = 0.0  # when the autoscaler last asked for more
    version: int = 0  # of `model`, the target; replicas of other versions are rolled over to it
    rollout: object | None = None  # a rolling update in progress (see rollout.py)
    last_rollout: str = ""
    evicted_at: float | None = None  # unloaded for memory; back at its next request

    @property
    def key(self) -> str:
        return self.model.key if self.role == "both" else f"{self.model.key}/{self.role}"

    @property
    def warm(self) -> int:
        return self.model.warm_standby if self.autoscaler is not None and self.evicted_at is None else 0

    def in_state(self, *states: Lifecycle) -> list[Slot]:
        return [s for s in self.slots if s.state in states]
