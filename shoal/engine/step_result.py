"""What one step of the engine core hands its front, and the engine's state after it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.engine.block_pool import KVEvent
from shoal.engine.expert_balance import BalanceStats
from shoal.engine.lora_manager import LoRAStats
from shoal.engine.outputs import EngineCoreOutput
from shoal.engine.parallel.messages import RankStats
from shoal.engine.speculative import SpecDecodeStats

if TYPE_CHECKING:
    from shoal.engine.scheduler_output import ModelRunnerOutput


@dataclass
class StepTimes:
    """Where the steps' time went: the model's forward and sampling, and the rest (host work); and
    the decode steps whose forward was queued by the step before (engine.decode_ahead)."""

    forward_seconds: float = 0.0
    host_seconds: float = 0.0
    steps_from_queue: int = 0
    queued_steps_dropped: int = 0

    def add(self, result: ModelRunnerOutput, elapsed: float) -> None:
        self.forward_seconds += min(result.forward_s, elapsed)
        self.host_seconds += max(0.0, elapsed - result.forward_s)
        self.steps_from_queue += result.from_queue
        self.queued_steps_dropped += result.queue_dropped


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    num_evictions: int
    spec: SpecDecodeStats | None = None  # with speculative decoding on
    ranks: list[RankStats] | None = None  # with tensor or pipeline parallelism
    num_waiting_tokens: int = 0  # tokens of the waiting requests (the front's admission bound)
    num_kv_held: int = 0  # finished requests whose K/V waits for another engine to take it
    num_steps: int = 0
    # Of the steps' time so far: the model's forward and sampling, and the engine's work around it.
    forward_seconds: float = 0.0
    host_seconds: float = 0.0
    # Decode steps whose forward was queued by the step before, and queued steps dropped unused.
    steps_from_queue: int = 0
    queued_steps_dropped: int = 0
    lora: LoRAStats | None = None  # with adapters enabled
    # With KV offload tiers: blocks put in and taken back from each tier ("host", "disk").
    kv_offload_saved: dict[str, int] | None = None
    kv_offload_loaded: dict[str, int] | None = None
    moe_expert_tokens: dict[int, list[int]] | None = None  # layer -> tokens each expert took
    moe_balance: BalanceStats | None = None  # expert load balancing across ranks


@dataclass
class StepResult:
    """What one step of the engine core hands its front: the choices' token deltas, the groups
    none of whose choices is left running (their streams end), the KV-cache events since the last
    step, and the engine's state after it."""

    outputs: list[EngineCoreOutput]
    finished_groups: set[str]
    kv_events: list[KVEvent]
    stats: EngineStats
