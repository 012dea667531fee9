"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time

from shoal.engine.sampling_params import SamplingParams
from shoal.protocol.block_hash import adapter_keys


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step failed for this request; the engine went on without it

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


class Request:
    """One sequence. An n>1 request is a parent (index 0) that forks n-1 children after its prefill."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        seed: int,
        priority: int = 0,
        arrival_time: float | None = None,
        extra_keys: tuple = (),
        group_id: str | None = None,
        index: int = 0,
        num_prompt_tokens: int | None = None,
        lora: str | None = None,
    ):
        """`num_prompt_tokens` below len(prompt_token_ids) resumes a request: the ids past it are
        output the request already produced (elsewhere), and count as such."""
        self.request_id = request_id
        self.group_id = group_id or request_id
        self.index = index
        self.params = params
        self.max_tokens = max_tokens
        self.seed = seed
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # The LoRA adapter it runs with (None: the base model), and its slot while it holds one.
        self.lora = lora
        self.lora_slot = 0
        # Its blocks' hashes cover the adapter: two adapters never share K/V.
        self.extra_keys = (*extra_keys, *adapter_keys(lora))
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.error: str | None = None
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []  # proposed for the next step (speculative decoding)
        self.num_emitted = len(self.token_ids) - self.num_prompt_tokens  # output tokens reported
        self.block_hashes: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache at first schedule
        self.num_preemptions = 0
        self.pending_children = params.n - 1 if index == 0 else 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # Disaggregation: keep the blocks after finishing, for another engine to take the K/V
        # (hold_kv); or the prompt's K/V arrives from another engine (external_kv, a PackedKV).
        self.hold_kv = False
        self.external_kv = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def sort_key(self) -> tuple[int, float]:
        """Smaller runs first: better priority (lower value), then older."""
        return (self.priority, self.arrival_time)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens})"
        )
