"""shoal: serve large language models from one CPU to a fleet."""

__version__ = "0.1.0"

from shoal.engine.sampling_params import SamplingParams
from shoal.llm import LLM

__all__ = ["LLM", "SamplingParams"]
