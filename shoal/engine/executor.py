"""Executors run the model for the scheduler: what every one offers (`Executor`), the one that
runs it in the calling process, and the one factory that picks between it and the ranks of a
tensor- or pipeline-parallel model (shoal.engine.parallel.executor)."""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.model_runner import ModelRunner
from shoal.engine.parallel.executor import MultiprocExecutor
from shoal.engine.parallel.messages import RankStats
from shoal.engine.runner_setup import build_runner
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.models.loader import LoadedModel
from shoal.models.moe import sparse_layers


class Executor(Protocol):
    """Runs steps, each one pickable SchedulerOutput, and answers with what was sampled.

    `max_in_flight`: how many steps may be submitted before the oldest result is collected (one
    per pipeline stage; 1 runs them one at a time). `moves_kv`: whether a request's K/V can be
    taken out (`export_kv`) or put in (a step's `external_kv`) for another engine."""

    max_in_flight: int
    moves_kv: bool

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput: ...

    def submit(self, so: SchedulerOutput) -> None: ...

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's result."""
        ...

    def export_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor: ...

    def export_blocks(self, sources: list[tuple[str, int]]) -> torch.Tensor:
        """Whole blocks' K/V from the pool or the offload tiers (ModelRunner.export_blocks)."""
        ...

    def tier_costs(self) -> dict[str, float] | None:
        """Seconds to load a block from each offload tier and to compute it, timed now (None:
        the executor does not time them, and its ranks load from the tiers always)."""
        ...

    @property
    def rank_stats(self) -> list[RankStats] | None:
        """Per-rank timings, for executors that have ranks."""
        ...

    def expert_load(self) -> dict[int, list[int]] | None:
        """Tokens each expert of each mixture-of-experts layer has taken (None: no experts here)."""
        ...

    def check_health(self) -> None:
        """Raises when no further step can run (a rank died between steps)."""
        ...

    def shutdown(self) -> None: ...


class UniprocExecutor:
    max_in_flight = 1
    moves_kv = True

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.moe_layers = sparse_layers(runner.model)  # none for a dense model: nothing to count
        self._submitted: deque[SchedulerOutput] = deque()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(so)

    def submit(self, so: SchedulerOutput) -> None:
        self._submitted.append(so)  # run when collected: this process has one stage

    def collect(self) -> ModelRunnerOutput:
        return self.runner.execute(self._submitted.popleft())

    def export_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        return self.runner.export_kv(block_ids, num_tokens)

    def export_blocks(self, sources: list[tuple[str, int]]) -> torch.Tensor:
        return self.runner.export_blocks(sources)

    def tier_costs(self) -> dict[str, float] | None:
        return self.runner.tier_costs()

    @property
    def rank_stats(self) -> list[RankStats] | None:
        return None

    def expert_load(self) -> dict[int, list[int]] | None:
        return {i: moe.expert_load() for i, moe in self.moe_layers.items()} or None

    def check_health(self) -> None:
        pass  # a step that fails here raises in the step itself

    def shutdown(self) -> None:
        self.runner.close()


def build_executor(
    config: EngineConfig, loaded: LoadedModel, num_blocks: int, max_model_len: int
) -> Executor:
    """The executor for this config: ranks for a tensor- or pipeline-parallel model, else this process."""
    if config.parallel.world_size > 1:
        if config.speculative.speculative == "draft":
            raise ValueError(
                "a draft model does not run under tensor or pipeline parallelism; use --speculative ngram"
            )
        return MultiprocExecutor(config, loaded, num_blocks, max_model_len)
    return UniprocExecutor(build_runner(config, loaded, num_blocks, max_model_len))
