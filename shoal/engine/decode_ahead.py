"""The next greedy decode step, queued on the device before the scheduler asks for it.

On a GPU a step's forward runs on its own once queued, and the host waits for its tokens; what the
host does between two steps (hand the tokens to the scheduler, schedule and prepare the next step,
launch it) leaves the device idle, and at small batches that is a third of the step. When every
row of a decode step is plain greedy, the next step's inputs are known before its tokens reach the
host: the same rows one position on, each fed the token just computed, still on the device. So the
runner queues that step right behind the current one and only then reads the current tokens. When
the scheduler's next step is exactly the queued one (same rows, tokens, positions, slots and
tables), its tokens are already computed or on the way; when it is not (a request finished, joined
or was preempted), the queued work is dropped and the step runs as usual. What the queued step
wrote is never wrong: each row's K/V at the next position, from the very token that sits there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.engine.attention import AttentionMetadata
from shoal.engine.block_tables import BlockTables
from shoal.engine.step_inputs import token_batch


class TokensOnTheWay:
    """A step's tokens, their copy to the host queued right behind the step: reading them waits
    for that step alone, not for the step queued after it."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens  # on the model's device: the next step's input
        self.done = None
        self.host = tokens
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


@dataclass
class QueuedStep:
    request_ids: list[str]
    positions: torch.Tensor  # [rows] on the host, as the runner prepares them
    slots: torch.Tensor
    tables: torch.Tensor
    tokens: TokensOnTheWay  # its greedy tokens
    fed: list[int] | None = None  # its input tokens, once the host has read them


class DecodeAhead:
    """Queues the decode step that follows one, and hands its tokens over when it is asked for."""

    def __init__(self, tables: BlockTables, block_size: int):
        self.tables = tables
        self.block_size = block_size
        self.queued: QueuedStep | None = None

    def take(
        self, request_ids: list[str], input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> tuple[TokensOnTheWay | None, bool]:
        """The queued step's tokens if it is the step prepared here (rows in the same order, the
        same inputs everywhere), and whether a queued step was dropped instead; the queued step is
        forgotten either way."""
        queued, self.queued = self.queued, None
        if queued is None:
            return None, False
        batch = md.token_batch
        same = (
            batch is not None
            and request_ids == queued.request_ids
            and input_ids.tolist() == queued.fed
            and torch.equal(positions, queued.positions)
            and torch.equal(md.slot_mapping, queued.slots)
            and torch.equal(batch.block_tables, queued.tables)
        )
        return (queued.tokens, False) if same else (None, True)

    def next_inputs(self, request_ids: list[str], positions: torch.Tensor) -> AttentionMetadata | None:
        """The metadata of the step after one at `positions` for these rows, or None when a row's
        next position lies in a block it does not have yet (the scheduler adds it with that step)."""
        tables, bs = self.tables, self.block_size
        rows = tables.rows(request_ids)
        nxt = positions + 1
        if any(b >= tables.num_blocks[r] for b, r in zip((nxt // bs).tolist(), rows.tolist())):
            return None
        return AttentionMetadata(
            tables.slots(rows, nxt, bs), [], [], None, token_batch(tables, rows, nxt, bs)
        )

    def queue(self, request_ids: list[str], md: AttentionMetadata, tokens: TokensOnTheWay) -> None:
        batch = md.token_batch
        self.queued = QueuedStep(
            request_ids, batch.context_lens - 1, md.slot_mapping, batch.block_tables, tokens
        )

    def fed(self, tokens: list[int]) -> None:
        """The queued step's input tokens, now read on the host (the current step's output)."""
        if self.queued is not None:
            self.queued.fed = tokens

    def drop(self) -> bool:
        """Forgets the queued step (the step now running is not one it could be); whether there was one."""
        dropped, self.queued = self.queued is not None, None
        return dropped
