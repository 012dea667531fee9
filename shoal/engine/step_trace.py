"""The engine's steps, each as a line of JSON (what it held, how long it took and when it ended), when the
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

    def add(self, so, seconds: float) -> None:
        if self._file is None:  # opened by the first step: an engine that never steps leaves no file
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (open for the engine's life)
        self._file.write(step_line(step_shape(so), seconds, ended=time.perf_counter()))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def step_line(shape: StepShape, seconds: float, ended: float | None = None) -> str:
    """`ended`: when the step ended, on the clock its seconds are timed on (time.perf_counter):
    what the engine did between two steps is then the gap between one's end and the next's start."""
    line = {**asdict(shape), "seconds": seconds}
    if ended is not None:
        line["ended"] = ended
    return json.dumps(line) + "\n"


def read_steps(path: str | Path) -> list[tuple[StepShape, float]]:
    """The steps of one file of step_line's lines, in their order; a line cut short is skipped."""
    steps = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
            seconds = row.pop("seconds")
            row.pop("ended", None)
            steps.append((StepShape(**row), seconds))
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def read_gaps(path: str | Path) -> list[float]:
    """The seconds between each step's end and the next one's start in one file of step_line's
    lines (lines without their end are skipped, and the gap across them)."""
    gaps, last_end = [], None
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
            started, ended = row["ended"] - row["seconds"], row["ended"]
        except (ValueError, KeyError, TypeError):
            last_end = None
            continue
        if last_end is not None:
            gaps.append(started - last_end)
        last_end = ended
    return gaps


def step_trace_files(directory: str | Path) -> list[Path]:
    """The files of every engine that traced its steps in `directory`, one an engine."""
    return sorted(Path(directory).glob("steps-*.jsonl"))
