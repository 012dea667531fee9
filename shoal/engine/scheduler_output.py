"""What one engine step asks of the model and what comes back: plain data, picklable, so that a
runner in another process (a tensor- or pipeline-parallel worker) can take it as it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.engine.outputs import TokenLogprob
from shoal.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or has forgotten, after a preemption): what it keeps
    across steps (sampling state) and its whole block table."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)  # produced before (resumed, preempted)
    block_ids: list[int] = field(default_factory=list)
    # The packed K/V of its first tokens, computed by another engine: loaded into its blocks before
    # the step runs (see engine.kv_connector).
    external_kv: Any = None
    lora_slot: int = 0  # the model's adapter slot for its rows (0: the base model alone)


@dataclass
class ScheduledRequest:
    """One request's part of a step: `token_ids` at positions from `start_pos` (a prompt chunk,
    or the last sampled token), then `spec_token_ids` (proposed tokens to verify) after them."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    spec_token_ids: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)  # appended to its table this step
    sample: bool = True  # the step reaches the end of its known tokens: sample what follows

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    step_id: int = 0
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # runner state to drop
    num_batched_tokens: int = 0
    # (slot, LoRAAdapter or None) to put in the model's adapter slots before the step runs
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)
    # K/V moved between the pool and the offload tiers before the step runs (engine.kv_tiers)
    kv_tier_moves: list[Any] = field(default_factory=list)
    # A new placement of replicated experts (engine/expert_balance.py), taken before the step runs
    expert_placement: dict[int, dict[int, list[int]]] | None = None
    # A request waits and the batch has room for it: the next step may take on a new row (so the
    # runner does not queue a copy of this step one token on, engine.decode_ahead).
    may_admit: bool = False

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    # request id -> tokens sampled this step (several when proposed tokens were accepted)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request id -> (prompt position of the first entry, logprobs of the prompt tokens that follow)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # request id -> tokens proposed for the next step (speculative decoding)
    proposed: dict[str, list[int]] = field(default_factory=dict)
    # request id -> (tokens proposed this step, how many were accepted)
    spec_results: dict[str, tuple[int, int]] = field(default_factory=dict)
    # request id -> its prompt's embedding (pooling requests, in the step that ends their prompt)
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    # Seconds of the model's forward, logits and sampling in this step (the rest is host work).
    forward_s: float = 0.0
    # The step was the one queued by the step before (engine.decode_ahead); a queued step was
    # dropped in it (the scheduler asked for another).
    from_queue: bool = False
    queue_dropped: bool = False

    def merge(self, other: ModelRunnerOutput) -> None:
        for name in ("sampled", "logprobs", "prompt_logprobs", "embeddings", "proposed", "spec_results"):
            getattr(self, name).update(getattr(other, name))
        self.forward_s += other.forward_s
        self.from_queue |= other.from_queue
        self.queue_dropped |= other.queue_dropped
