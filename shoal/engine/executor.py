"""Executors run the model for the scheduler; this one runs it in the calling process."""

from __future__ import annotations

from shoal.engine.model_runner import ModelRunner
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


class UniprocExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(so)

    def export_kv(self, block_ids: list[int], num_tokens: int):
        return self.runner.export_kv(block_ids, num_tokens)

    def shutdown(self) -> None:
        pass
