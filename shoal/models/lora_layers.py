"""Several LoRA adapters in one batch: each projection an adapter may target holds a stack of slots
(slot 0 is no adapter), and each row of a step names its slot.

Each row adds B @ (A @ x) of its own slot to the base projection's output (Punica's BGMV): in C on
CPU (shoal/kernels/cpu_lora.c, also inside the fused decode layer), elsewhere segmented in torch,
one shrink and one expand per adapter present. The base projection runs once for the whole batch,
whatever its weights (fp32, int8, int4): adapters stay in floating point."""

from __future__ import annotations

import torch
from torch import nn

from shoal.kernels.cpu import LORA_DTYPE_IDS, kernels_for
from shoal.models.llama import PACKED_PARTS, PROJECTIONS, LlamaForCausalLM
from shoal.models.lora import MLP_MODULES, LoRAAdapter, module_shapes


class LoRABatch:
    """Which slot each row of the current step uses; the runner sets it before each forward."""

    def __init__(self):
        self.row_slots: torch.Tensor | None = None  # int64 [rows]; None when no row has an adapter
        self._segments: list[tuple[int, torch.Tensor]] | None = None

    def set_rows(self, slots: list[int], device: torch.device) -> None:
        self.row_slots = torch.tensor(slots, dtype=torch.int64, device=device) if any(slots) else None
        self._segments = None

    def clear(self) -> None:
        self.row_slots = None
        self._segments = None

    def segments(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, row indices) for each adapter present, computed once per step."""
        if self._segments is None:
            rows = self.row_slots
            slots = [] if rows is None else sorted(set(rows.tolist()) - {0})
            self._segments = [(slot, (rows == slot).nonzero().flatten()) for slot in slots]
        return self._segments


class LoRAStack:
    """One target module's slots: A [S, r_max, in], B transposed [S, r_max, out] (zero past each
    slot's rank), and each slot's rank (int64 [S], 0 when its adapter leaves the module alone)."""

    def __init__(self, num_slots: int, max_rank: int, fan_in: int, fan_out: int, dtype, device):
        self.a = torch.zeros(num_slots, max_rank, fan_in, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, max_rank, fan_out, dtype=dtype, device=device)
        self.ranks = torch.zeros(num_slots, dtype=torch.int64)  # read by C, so on the host
        self.fan_out = fan_out

    def put(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """a [r, in] and b [out, r] as PEFT stores them (b already scaled), or None to empty."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot] = 0 if a is None else a.shape[0]
        if a is not None:
            r = a.shape[0]
            self.a[slot, :r].copy_(a)
            self.b[slot, :r].copy_(b.t())

    def add_torch(self, x: torch.Tensor, y: torch.Tensor, offset: int, segments) -> None:
        """The reference: each adapter's rows through one shrink and one expand."""
        ranks = self.ranks.tolist()
        for slot, rows in segments:
            r = ranks[slot]
            if r == 0:
                continue
            a, b = self.a[slot, :r].to(x.dtype), self.b[slot, :r].to(x.dtype)
            delta = (x.index_select(0, rows) @ a.t()) @ b
            y[:, offset : offset + self.fan_out].index_add_(0, rows, delta.to(y.dtype))


class LoRAProjection(nn.Module):
    """A base projection plus the step's adapters. `parts`: (output offset, LoRAStack) for each
    HF module fused into this projection (q, k, v into qkv_proj; gate, up into gate_up_proj)."""

    def __init__(self, base: nn.Module, parts: list[tuple[int, LoRAStack]], batch: LoRABatch):
        super().__init__()
        self.base = base
        self.parts = parts
        self.batch = batch
        self._kernel_params = None  # the parts as C reads them, made on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.batch.row_slots
        if rows is None:
            return y
        a = self.parts[0][1].a
        kernels = kernels_for(x, y) if a.device.type == "cpu" and a.dtype in LORA_DTYPE_IDS else None
        if kernels is None:
            for offset, stack in self.parts:
                stack.add_torch(x, y, offset, self.batch.segments())
            return y
        if self._kernel_params is None:
            self._kernel_params = [kernels.lora_params(s.a, s.b, s.ranks, offset) for offset, s in self.parts]
        for params in self._kernel_params:
            kernels.lora_apply(params, x, rows, y)
        return y


class LoRASlots:
    """The model's adapter slots (1..num_slots; 0 is the base alone) and the batch they serve."""

    def __init__(
        self, model: LlamaForCausalLM, num_slots: int, max_rank: int, dtype: torch.dtype | None = None
    ):
        if model.shard.tp_size > 1 or model.shard.pp_size > 1:
            raise ValueError("LoRA adapters with tensor or pipeline parallelism are not supported yet")
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.batch = LoRABatch()
        cfg = model.cfg
        shapes = module_shapes(cfg)
        dtype, device = dtype or model.dtype, next(model.parameters()).device
        self.stacks: dict[tuple[int, str], LoRAStack] = {}
        for i, layer in enumerate(model.layers):
            for fused in PROJECTIONS:
                if not hasattr(layer, fused):
                    continue  # a mixture of experts' layer: adapters reach its attention only
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
    """Bytes one adapter slot takes in the model (every target module at the maximum rank; a
    mixture of experts' layers have their attention's)."""
    total = 0
    for layer in range(cfg.num_layers):
        for module, (fan_in, fan_out) in module_shapes(cfg).items():
            if module not in MLP_MODULES or not cfg.is_sparse(layer):
                total += (fan_in + fan_out) * max_rank
    return total * dtype.itemsize
