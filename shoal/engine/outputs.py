"""What the engine hands back: per-token logprobs and per-request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)  # top-N (id, logprob), best first


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # What this step added (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # a step failed for this request (it finished with it)
    embedding: list[float] | None = None  # its prompt's, for a request with `pooling`


@dataclass
class EngineCoreOutput:
    """One choice's progress in one step, as the engine reports it: tokens, no text (the front
    detokenizes). Plain data."""

    request_id: str  # the engine's request: the group's id for choice 0, "{group}#{i}" after
    group_id: str
    index: int
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: tuple[int, list[TokenLogprob]] | None = None  # (first position, entries)
    embedding: list[float] | None = None
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
