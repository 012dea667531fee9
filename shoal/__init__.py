"""shoal: serve large language models from one CPU to a fleet."""

__version__ = "0.1.0"
