"""The engine's steps, each as a line of JSON (what it held, how long it took and when it ended), when the
environment names a directory for them (SHOAL_STEP_TRACE_DIR, inherited by every replica a fleet
starts): the serving processes' own record of how fast their steps ran, which a profile prices
(shoal/sim/speed_probe.py) to read the host's speed during a run without a probe beside it."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
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

    def add(self, so, seconds: float, pending: int) -> None:
        """`pending`: the requests the engine still had to run when the step ended."""
        if self._file is None:  # opened by the first step: an engine that never steps leaves no file
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (open for the engine's life)
        self._file.write(step_line(step_shape(so), seconds, ended=time.perf_counter(), pending=pending))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def step_line(
    shape: StepShape, seconds: float, ended: float | None = None, pending: int | None = None
) -> str:
    """`ended`: when the step ended, on the clock its seconds are timed on (time.perf_counter):
    what the engine did between two steps is then the gap between one's end and the next's start.
    `pending`: the requests it still had to run then (with some, the gap after is its own work)."""
    line = {**asdict(shape), "seconds": seconds}
    if ended is not None:
        line["ended"] = ended
    if pending is not None:
        line["pending"] = pending
    return json.dumps(line) + "\n"


@dataclass(frozen=True)
class Gap:
    """The time between one traced step's end and the next one's start."""

    seconds: float
    # The requests the engine still had to run as the step before it ended (None: not traced).
    # With any, the engine spent the gap on its own work between steps, however long; with none,
    # it waited for work after whatever it did first.
    pending: int | None = None


def read_steps(path: str | Path) -> list[tuple[StepShape, float]]:
    """The steps of one file of step_line's lines, in their order; a line cut short is skipped."""
    return [(shape, seconds) for shape, seconds, _ in read_timed_steps(path)]


def read_timed_steps(path: str | Path) -> list[tuple[StepShape, float, float | None]]:
    """read_steps, each step with when it ended (None: not traced)."""
    steps = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
            seconds = row.pop("seconds")
            ended = row.pop("ended", None)
            row.pop("pending", None)
            steps.append((StepShape(**row), seconds, ended))
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def read_gaps(path: str | Path) -> list[Gap]:
    """The gaps between each step's end and the next one's start in one file of step_line's lines
    (lines without their end are skipped, and the gap across them)."""
    gaps, last_end, last_pending = [], None, None
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
            started, ended = row["ended"] - row["seconds"], row["ended"]
        except (ValueError, KeyError, TypeError):
            last_end = None
            continue
        if last_end is not None:
            gaps.append(Gap(started - last_end, last_pending))
        last_end, last_pending = ended, row.get("pending")
    return gaps


def step_trace_files(directory: str | Path) -> list[Path]:
    """The files of every engine that traced its steps in `directory`, one an engine."""
    return sorted(Path(directory).glob("steps-*.jsonl"))
