"""What an engine step holds, as a cost model reads it: rows, tokens computed, and the context they
attend to (the simulator prices steps by it; the engine's step trace records it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepShape:
    """What a step holds: per row, the tokens it computes now and the context they attend to."""

    rows: int = 0
    tokens: int = 0  # computed this step, over all rows (a decode row: 1, or 1 + drafts)
    context: int = 0  # sum over rows of the context length at the row's end
    attention: int = 0  # sum over rows of tokens x context: the attention work of prefills
    # Requests the step takes in for the first time (or again, after a preemption). No cost model
    # reads it; a trace that counts them shows what several new requests at once do to a served
    # step (README, issue 31: on a host whose cores replicas all hold, 0-50 ms each beyond the first).
    admitted: int = 0

    @property
    def decode_only(self) -> bool:
        return self.tokens == self.rows

    def add_row(self, tokens: int, start: int) -> None:
        end = start + tokens
        self.rows += 1
        self.tokens += tokens
        self.context += end
        self.attention += tokens * end


def step_shape(so) -> StepShape:
    """What a scheduled step (a SchedulerOutput) holds."""
    shape = StepShape()
    for sr in so.scheduled:
        shape.add_row(len(sr.token_ids) + len(sr.spec_token_ids), sr.start_pos)
    shape.admitted = len(so.new_requests)
    return shape
