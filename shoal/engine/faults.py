"""Fault injection for tests of failure handling: real crashes and real step errors, triggered by a
marker in a prompt. Off unless the environment names a marker; read once per engine."""

from __future__ import annotations

import os
from dataclasses import dataclass


class InjectedCrash(BaseException):
    """Kills the engine loop (a BaseException, so no per-request handler swallows it)."""


class InjectedStepError(RuntimeError):
    """Fails one step, as a bug in one request's path through the model would."""


@dataclass(frozen=True)
class FaultConfig:
    crash_on: str | None = None  # a prompt containing this kills the engine loop
    step_error_on: str | None = None  # a step running a prompt containing this raises
    # ... raises after the model ran and sampled: the runner has taken the step's tokens
    sampled_error_on: str | None = None

    @classmethod
    def from_env(cls) -> FaultConfig:
        return cls(
            os.environ.get("SHOAL_FAULT_CRASH_ON") or None,
            os.environ.get("SHOAL_FAULT_STEP_ERROR_ON") or None,
            os.environ.get("SHOAL_FAULT_SAMPLED_ERROR_ON") or None,
        )

    @property
    def active(self) -> bool:
        return bool(self.crash_on or self.step_error_on or self.sampled_error_on)
