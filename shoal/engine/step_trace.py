"""The engine's steps, each as a line of JSON (what it held and how long it took), when the
environment names a directory for them (SHOAL_STEP_TRACE_DIR, inherited by every replica a fleet
starts): the serving processes' own record of how fast their steps ran, which a profile prices
(shoal/sim/speed_probe.py) to read the host's speed during a run without a probe beside it."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from shoal.engine.step_shape import StepShape, step_shape

STEP_TRACE_ENV = "SHOAL_STEP_TRACE_DIR"


class StepTrace:
    """Appends each step to a file of its own in `directory` (one per engine: a process may run
    several); line-buffered, so a replica killed mid-run leaves every step it finished."""

    def __init__(self, directory: str):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"steps-{os.getpid()}-{time.monotonic_ns()}.jsonl"
        self._file = None

    @classmethod
    def from_env(cls) -> StepTrace | None:
        directory = os.environ.get(STEP_TRACE_ENV)
        return cls(directory) if directory else None

    def add(self, so, seconds: float, cpu_seconds: float) -> None:
        """A step of `seconds` on the clock, `cpu_seconds` of them on the engine's thread."""
        if self._file is None:  # opened by the first step: an engine that never steps leaves no file
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (open for the engine's life)
        self._file.write(step_line(step_shape(so), seconds, cpu_seconds))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def step_line(shape: StepShape, seconds: float, cpu_seconds: float | None = None) -> str:
    times = {"seconds": seconds} if cpu_seconds is None else {"seconds": seconds, "cpu_seconds": cpu_seconds}
    return json.dumps({**asdict(shape), **times}) + "\n"


def read_steps(path: str | Path, clock: str = "seconds") -> list[tuple[StepShape, float]]:
    """The steps of one file of step_line's lines, in their order, each with its time on `clock`
    ("seconds", or "cpu_seconds": the engine thread's); a line cut short is skipped."""
    steps = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
            times = {k: row.pop(k) for k in ("seconds", "cpu_seconds") if k in row}
            steps.append((StepShape(**row), times[clock]))
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def read_step_traces(directory: str | Path, clock: str = "seconds") -> list[tuple[StepShape, float]]:
    """Every step traced in `directory`, by any engine (see read_steps)."""
    paths = sorted(Path(directory).glob("steps-*.jsonl"))
    return [step for path in paths for step in read_steps(path, clock)]
