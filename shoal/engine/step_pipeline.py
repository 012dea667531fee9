"""Steps kept in flight for pipeline parallelism.

With M pipeline stages, one step at a time would leave M - 1 stages idle. This keeps up to M
steps submitted: each takes its share of the running requests (a request is in at most one step
at a time, as its next token depends on the last), the first stage starts the next step while
the later ones finish the previous, and results are taken back in order.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from shoal.engine.parallel.executor import ExecutorDeadError
from shoal.engine.scheduler import Scheduler
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from shoal.engine.executor import Executor

log = logging.getLogger(__name__)


class StepPipeline:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        depth: int,
        check_faults: Callable[[SchedulerOutput], None],
        run_parts: Callable[[SchedulerOutput, Exception], tuple[ModelRunnerOutput, dict[str, str]]],
    ):
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        self.check_faults = check_faults
        self.run_parts = run_parts
        self.pending: deque[SchedulerOutput] = deque()  # submitted, oldest first
        self.ready: dict[int, ModelRunnerOutput | Exception] = {}  # results taken out of turn

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def step(self) -> tuple[SchedulerOutput | None, ModelRunnerOutput, dict[str, str]]:
        """Fills the pipeline, then returns the oldest step with its result and failed requests
        (None when nothing was in flight)."""
        while len(self.pending) < self.depth:
            share = -(-self.scheduler.num_unfinished // self.depth)
            so = self.scheduler.schedule(max_seqs=max(1, share))
            if so.empty and not so.finished_ids:
                break
            self._submit(so)
            if so.empty:
                break
        if not self.pending:
            return None, ModelRunnerOutput(), {}
        so = self.pending.popleft()
        try:
            result = self.ready.pop(so.step_id) if so.step_id in self.ready else self.executor.collect()
            if isinstance(result, Exception):
                raise result
            return so, result, {}
        except ExecutorDeadError:
            raise
        except Exception as exc:
            if not so.scheduled:
                raise
            # The steps behind it have run: take their results first, so that its requests can
            # run again one by one with nothing else in flight.
            for later in self.pending:
                if later.step_id not in self.ready:
                    self.ready[later.step_id] = self._collect_one()
            result, failures = self.run_parts(so, exc)
            return so, result, failures

    def _submit(self, so: SchedulerOutput) -> None:
        self.pending.append(so)
        try:
            self.check_faults(so)
        except ExecutorDeadError:
            raise
        except Exception as exc:  # a step that fails before it is sent is failed in its turn
            self.ready[so.step_id] = exc
            return
        self.executor.submit(so)

    def _collect_one(self) -> ModelRunnerOutput | Exception:
        try:
            return self.executor.collect()
        except ExecutorDeadError:
            raise
        except Exception as exc:
            return exc
