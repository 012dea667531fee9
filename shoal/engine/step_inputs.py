"""A step's flattened batch: its input ids, positions and attention metadata, gathered from the
runner's persistent block tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from shoal.engine.attention import (
    AttentionMetadata,
    DecodeBatch,
    DecodeGroup,
    PrefillSpan,
    decode_mask,
    group_by_length,
    prefill_mask,
)
from shoal.engine.block_tables import BlockTables


@dataclass(slots=True)
class ScheduledChunk:
    """One request's rows in the flattened batch: its scheduled tokens, then any proposed tokens
    (the last `num_spec` rows), all sampled from when `sample`. Its block table is the runner's
    (`ModelRunner.tables`)."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    sample: bool
    num_spec: int = 0

    @property
    def num_sampled_rows(self) -> int:
        return (self.num_spec + 1) if self.sample else 0


def token_batch(
    tables: BlockTables, token_rows: torch.Tensor, pos: torch.Tensor, block_size: int
) -> DecodeBatch:
    """Every row as one query over its own context: its table up to its position, its context
    length (what a fast path takes, `AttentionMetadata.token_batch`)."""
    width = -(-(int(pos.max()) + 1) // block_size)
    return DecodeBatch(len(pos), tables.table[token_rows, :width], pos + 1)


class StepInputs:
    """Builds each step's inputs. `decode_in_groups`: the reference attention's choice of decode
    metadata; `wants_token_batch(rows, has_prefills)`: whether a fast path takes a step of that
    shape (it then gets per-row tables, and nothing else is built)."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        window: int | None,
        decode_in_groups: bool,
        wants_token_batch: Callable[[int, bool], bool],
    ):
        self.block_size = block_size
        self.device = device
        self.window = window
        self.decode_in_groups = decode_in_groups
        self.wants_token_batch = wants_token_batch

    def prepare(self, chunks: list[ScheduledChunk], tables: BlockTables, reference_too: bool = False):
        """The step's flattened input ids and positions, and its attention metadata, gathered from
        the persistent block tables. `reference_too`: the reference path's metadata as well, for a
        step a fast path takes (to compare the two)."""
        bs, dev = self.block_size, self.device
        lens = [len(c.token_ids) for c in chunks]
        starts = [c.start_pos for c in chunks]
        rows = tables.rows([c.request_id for c in chunks])
        num_tokens = sum(lens)
        if num_tokens == len(chunks):  # one token a row: a decode step
            ids = [c.token_ids[0] for c in chunks]
            pos = torch.tensor(starts, dtype=torch.int64)
            token_rows = rows
        else:
            ids = [t for c in chunks for t in c.token_ids]
            counts = torch.tensor(lens, dtype=torch.int64)
            firsts = torch.tensor(list(accumulate(lens, initial=0))[:-1], dtype=torch.int64)
            token_rows = rows.repeat_interleave(counts)
            offset = torch.arange(num_tokens) - firsts.repeat_interleave(counts)
            pos = torch.tensor(starts, dtype=torch.int64).repeat_interleave(counts) + offset
        slots = tables.slots(token_rows, pos, bs)
        num_decode = lens.count(1)  # they come first (see execute's sort)
        fast = None
        if self.wants_token_batch(num_tokens, num_decode < len(chunks)):
            fast = token_batch(tables, token_rows, pos, bs)
            if not reference_too:
                # A fast path takes the step whole, from per-row tables: none of the reference
                # attention's metadata is built, and the inputs stay on the host for the path to send.
                return torch.tensor(ids), pos, AttentionMetadata(slots, [], [], None, fast)
        window = self.window
        ctx = [s + 1 for s in starts[:num_decode]]
        groups, batch = [], None
        if self.decode_in_groups:
            for start, end in group_by_length(ctx):
                length = ctx[end - 1]
                table = tables.padded(rows[start:end], length, bs).to(dev)
                mask = decode_mask(ctx[start:end], length, window, dev)
                groups.append(DecodeGroup(start, end, length, table, mask))
        elif num_decode:
            # Rows are sorted by context, so the last is the longest.
            table = tables.padded(rows[:num_decode], ctx[-1], bs).to(dev)
            batch = DecodeBatch(num_decode, table, torch.tensor(ctx, device=dev))
        prefills, row = [], num_decode
        for i in range(num_decode, len(chunks)):
            n, start = lens[i], starts[i]
            context = start + n
            table = None if start == 0 else tables.padded(rows[i : i + 1], context, bs)[0].to(dev)
            prefills.append(PrefillSpan(row, row + n, context, table, prefill_mask(n, context, window, dev)))
            row += n
        md = AttentionMetadata(slots.to(dev), groups, prefills, batch, fast)
        return torch.tensor(ids, device=dev), pos.to(dev), md
