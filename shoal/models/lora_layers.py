"""Several LoRA adapters in one batch: each projection an adapter may target holds a stack of slots
(slot 0 is no adapter), and each row of a step names its slot.

The product is segmented, as Punica's SGMV is: the rows of each adapter present in the step go
through one shrink (x @ A^T) and one expand (@ B^T) of that adapter's slot, and the result is
added to the base projection's output for those rows. The base projection runs once for the
whole batch, whatever its weights (fp32, int8, int4): adapters stay in floating point."""

from __future__ import annotations

import torch
from torch import nn

from shoal.models.llama import PACKED_PARTS, PROJECTIONS, LlamaForCausalLM
from shoal.models.lora import LoRAAdapter, module_shapes


class LoRABatch:
    """Which slot each row of the current step uses; the runner sets it before each forward."""

    def __init__(self):
        self.segments: list[tuple[int, torch.Tensor]] = []  # (slot, row indices), slot > 0

    def set_rows(self, slots: list[int], device: torch.device) -> None:
        self.segments = []
        if not any(slots):
            return
        rows = torch.tensor(slots, dtype=torch.int64)
        for slot in sorted(set(slots) - {0}):
            self.segments.append((slot, (rows == slot).nonzero().flatten().to(device)))

    def clear(self) -> None:
        self.segments = []


class LoRAStack:
    """One target module's slots: A [S, r_max, in], B [S, out, r_max] (zero in unused columns)."""

    def __init__(self, num_slots: int, max_rank: int, fan_in: int, fan_out: int, dtype, device):
        self.a = torch.zeros(num_slots, max_rank, fan_in, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, fan_out, max_rank, dtype=dtype, device=device)
        self.ranks = [0] * num_slots

    def put(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot] = 0 if a is None else a.shape[0]
        if a is not None:
            r = a.shape[0]
            self.a[slot, :r].copy_(a)
            self.b[slot, :, :r].copy_(b)


class LoRAProjection(nn.Module):
    """A base projection plus the step's adapters. `parts`: (output offset, LoRAStack) for each
    HF module fused into this projection (q, k, v into qkv_proj; gate, up into gate_up_proj)."""

    def __init__(self, base: nn.Module, parts: list[tuple[int, LoRAStack]], batch: LoRABatch):
        super().__init__()
        self.base = base
        self.parts = parts
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self.batch.segments:
            xs = x.index_select(0, rows)
            for offset, stack in self.parts:
                r = stack.ranks[slot]
                if r == 0:  # this adapter leaves this module alone
                    continue
                a, b = stack.a[slot, :r], stack.b[slot, :, :r]
                delta = (xs @ a.t()) @ b.t()
                y[:, offset : offset + b.shape[0]].index_add_(0, rows, delta.to(y.dtype))
        return y


class LoRASlots:
    """The model's adapter slots (1..num_slots; 0 is the base alone) and the batch they serve."""

    def __init__(self, model: LlamaForCausalLM, num_slots: int, max_rank: int):
        if model.shard.tp_size > 1 or model.shard.pp_size > 1:
            raise ValueError("LoRA adapters with tensor or pipeline parallelism are not supported yet")
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.batch = LoRABatch()
        cfg = model.cfg
        shapes = module_shapes(cfg)
        dtype, device = model.dtype, next(model.parameters()).device
        self.stacks: dict[tuple[int, str], LoRAStack] = {}
        for i, layer in enumerate(model.layers):
            for fused in PROJECTIONS:
                parts, offset = [], 0
                for module in PACKED_PARTS.get(fused, (fused,)):
                    fan_in, fan_out = shapes[module]
                    stack = LoRAStack(num_slots + 1, max_rank, fan_in, fan_out, dtype, device)
                    self.stacks[(i, module)] = stack
                    parts.append((offset, stack))
                    offset += fan_out
                setattr(layer, fused, LoRAProjection(getattr(layer, fused), parts, self.batch))

    def load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Puts an adapter's weights in a slot (None empties it)."""
        if not 1 <= slot <= self.num_slots:
            raise ValueError(f"slot {slot} is not in 1..{self.num_slots}")
        weights = {} if adapter is None else adapter.weights
        for key, stack in self.stacks.items():
            a, b = weights.get(key, (None, None))
            stack.put(slot, a, b)


def slot_bytes(cfg, max_rank: int, dtype: torch.dtype) -> int:
    """Bytes one adapter slot takes in the model (every target module at the maximum rank)."""
    per_layer = sum((fan_in + fan_out) * max_rank for fan_in, fan_out in module_shapes(cfg).values())
    return per_layer * cfg.num_layers * dtype.itemsize
