"""Per-request sampling options, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
# Below this temperature sampling is greedy: dividing logits by it would overflow to inf and NaN.
MIN_TEMPERATURE = 1e-5
# Bounds on per-request lists: each is consulted every step, for every row.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 2048


class InvalidParamError(ValueError):
    """Bad user input; `param` names the offending field for API error bodies."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


POOLINGS = ("mean", "last")  # how an embedding pools the final hidden states


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # 0: score the prompt only (with prompt_logprobs), generate nothing
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N alternatives per generated token; 0 = only the sampled one
    # Logprobs of the prompt's own tokens (and top-N alternatives); computing them bypasses the
    # prefix cache, since cached tokens are never run through the model.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # when set, only these tokens can be sampled
    # A grammar the output must follow (shoal.engine.structured.StructuredOutput), or None.
    structured: Any = None
    # An embedding of the prompt instead of output (max_tokens 0): its final hidden states pooled
    # ("mean" of every position, or the "last" one's), L2-normalized. Mean pooling bypasses the
    # prefix cache, as prompt_logprobs do.
    pooling: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        floats = (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        )
        for name in floats:
            if not math.isfinite(getattr(self, name)):
                raise InvalidParamError(f"{name} must be a finite number", name)
        checks = [
            (self.n >= 1, "n", "n must be at least 1"),
            (self.temperature >= 0, "temperature", "temperature must be non-negative"),
            (0 <= self.top_p <= 1, "top_p", "top_p must be in [0, 1]"),
            (self.top_k >= -1, "top_k", "top_k must be -1, 0 (disabled) or positive"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "repetition_penalty must be positive"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (
                self.max_tokens is None or self.max_tokens >= 0,
                "max_tokens",
                "max_tokens must be non-negative",
            ),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be non-negative"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "min_tokens must not exceed max_tokens",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids must be non-negative"),
            (
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids",
            ),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings"),
            (
                all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
                "stop",
                f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters",
            ),
            (
                len(self.logit_bias) <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"at most {MAX_LOGIT_BIAS} logit_bias entries",
            ),
            (
                all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias.items()),
                "logit_bias",
                "logit_bias maps token ids to biases in [-100, 100]",
            ),
            (self.pooling in (None, *POOLINGS), "pooling", f"pooling must be one of {', '.join(POOLINGS)}"),
            (self.pooling is None or self.max_tokens == 0, "max_tokens", "an embedding generates nothing"),
            (
                self.allowed_token_ids is None
                or (len(self.allowed_token_ids) > 0 and min(self.allowed_token_ids) >= 0),
                "allowed_token_ids",
                "allowed_token_ids must be a non-empty list of token ids",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidParamError(message, param)

    @property
    def needs_every_row(self) -> bool:
        """Whether every prompt token must run through the model (none taken from a cache)."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1 or self.top_p == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but the model decides the logits the sampler sees."""
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or self.structured is not None
        )
