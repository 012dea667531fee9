"""shoal: serve large language models from one CPU to a fleet."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]

if TYPE_CHECKING:
    from shoal.engine.sampling_params import SamplingParams
    from shoal.llm import LLM


def __getattr__(name: str) -> Any:
    # Imported on first use: the gateway and the load generator import shoal's lighter modules and
    # must not load torch and the engine with them.
    if name == "LLM":
        from shoal.llm import LLM

        return LLM
    if name == "SamplingParams":
        from shoal.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
