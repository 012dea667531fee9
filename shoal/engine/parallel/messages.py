"""What the driver and its ranks send each other (defined apart from the worker's entry point,
so that they unpickle the same on both sides)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from shoal.engine.config import EngineConfig
from shoal.engine.parallel.model_files import ModelFiles


@dataclass
class WorkerSetup:
    """What the driver tells a rank once it has connected."""

    config: EngineConfig
    num_blocks: int
    max_model_len: int
    store_port: int  # the rendezvous, on the driver's host (ranks reach it as they reached the driver)
    run_id: str  # names this run's shared-memory segments
    model: ModelFiles | None = None  # the driver's model, for a rank whose host lacks it


@dataclass
class RankStats:
    """A rank's cumulative profile: time in steps, in collectives, and waiting for the previous
    pipeline stage. Sent with every step's reply."""

    rank: int
    steps: int = 0
    step_s: float = 0.0
    comm_s: float = 0.0
    comm_calls: int = 0
    stage_wait_s: float = 0.0
    # Mixture of experts: for each of the rank's sparse layers (by its index in the whole model),
    # its first expert's id and the tokens each of its experts has taken.
    expert_tokens: dict[int, tuple[int, list[int]]] | None = None
    # Of comm_s, the sparse layers' share: sending tokens to their experts' ranks (none under the
    # all-reduce dispatch), and putting the experts' outputs together.
    moe_dispatch_s: float = 0.0
    moe_combine_s: float = 0.0


@dataclass(frozen=True)
class RankPlace:
    rank: int
    tp_size: int
    pp_size: int

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def answers(self) -> bool:
        """The rank whose reply carries the step's sampled tokens: the last stage's first."""
        return self.pp_rank == self.pp_size - 1 and self.tp_rank == 0


def rank_threads(config: EngineConfig) -> int:
    """Threads per rank: as configured, or the cores this process may use (its affinity: a fleet
    pins each replica to its share) shared among the ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return config.num_threads or max(1, cores // config.parallel.world_size)
