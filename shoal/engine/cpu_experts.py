"""A mixture of experts' routed experts as one C call on CPU (`shoal_moe_experts` in
shoal/kernels/cpu_layer.c): the same grouping as SparseMoE.run_experts (one product per active
expert, on all of its tokens), without a round of Python and torch dispatch per expert, which at
decode sizes costs about what the expert's weights take to read. The torch path stays the
reference (tests/test_moe.py compares the two) and runs where this does not: activations that
are not float32, and float32 experts with more rows than the C call is faster for (timed on the
layer's own experts: a lone float32 matmul's crossover does not say, since on a 2-core Xeon
torch's beat the C kernel at one row while the fused call beat torch's loop over 576-wide experts
up to 64 rows an expert)."""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.cpu_decode import projection_params
from shoal.kernels.abi import ProjectionParams
from shoal.kernels.cpu import CpuKernels, kernels_for
from shoal.models.moe import SparseMoE, sparse_layers
from shoal.models.quant import BlockQuantLinear, Int8Linear

RUNS_IN_C = (nn.Linear, Int8Linear, BlockQuantLinear)
# Rows for one expert at which the float32 crossover is timed: decode batches to prompt chunks.
FUSED_ROWS = (1, 4, 16, 64)


class CpuFusedExperts:
    """Called by its SparseMoE with the step's work: (expert, module, first, end) of its sorted
    choices; returns the summed outputs, or None to leave the step to torch."""

    def __init__(self, kernels: CpuKernels, moe: SparseMoE):
        self.kernels, self.moe = kernels, moe
        self._held: tuple | None = None  # the experts the arrays below were built for
        self._arrays: tuple | None = None
        self._float32 = False

    def _params(self) -> tuple | None:
        """Each expert's projections as C reads them, rebuilt when the rank's experts change (a
        rebalancing adds or drops replicas); None when one of them is not a kind C runs."""
        experts = self.moe.computed_here()
        held = tuple((e, id(m)) for e, m in experts)
        if held != self._held:
            count = self.moe.gate.out_features
            gate_up, down = (ProjectionParams * count)(), (ProjectionParams * count)()
            self._float32, usable = False, True
            for e, module in experts:
                if not all(isinstance(p, RUNS_IN_C) for p in (module.gate_up_proj, module.down_proj)):
                    usable = False
                    break
                gate_up[e] = projection_params(self.kernels, module.gate_up_proj)
                down[e] = projection_params(self.kernels, module.down_proj)
                self._float32 |= isinstance(module.down_proj, nn.Linear)
            self._held, self._arrays = held, ((gate_up, down) if usable else None)
        return self._arrays

    def __call__(self, h: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None, work: list):
        if not work or kernels_for(h) is None or (scale is not None and kernels_for(scale) is None):
            return None
        widest = max(end - first for _, _, first, end in work)
        if self._params() is None or (self._float32 and self.uses_torch(widest)):
            return None
        return self.run_in_c(h, rows, scale, work)

    def uses_torch(self, widest: int) -> bool:
        """Whether torch's loop beats the C call with `widest` rows for one expert (float32)."""
        start = self.torch_from_rows()
        return start is not None and widest >= start

    def torch_from_rows(self) -> int | None:
        """The crossover of this layer's shapes, timed on its first experts at decode and prompt
        widths (each on its own rows, as many experts as a token picks)."""
        experts = self.moe.computed_here()[: self.moe.top_k]
        hidden = self.moe.gate.in_features

        def calls_at(n: int):
            rows = torch.arange(n).repeat(len(experts))
            work = [(e, m, i * n, (i + 1) * n) for i, (e, m) in enumerate(experts)]
            args = (torch.randn(n, hidden), rows, torch.ones(len(rows)), work)
            return (lambda: self.run_in_c(*args)), (lambda: self.moe.run_in_torch(*args))

        key = ("moe_f32", hidden, experts[0][1].down_proj.in_features, len(experts))
        return self.kernels.tuner.fused_crossover(key, calls_at, FUSED_ROWS)

    def run_in_c(self, h: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None, work: list):
        """The routed experts in one C call, whatever the crossover (None: a projection C cannot run)."""
        if self._params() is None:
            return None
        gate_up, down = self._arrays
        starts, ends = [0] * self.moe.gate.out_features, [0] * self.moe.gate.out_features
        for e, _, first, end in work:
            starts[e], ends[e] = first, end
        starts, ends = torch.tensor(starts), torch.tensor(ends)
        width = work[0][1].down_proj.in_features  # an expert's intermediate size
        return self.kernels.moe_experts(gate_up, down, width, h, rows.contiguous(), scale, starts, ends)


def attach_fused_experts(kernels: CpuKernels, model: nn.Module) -> int:
    """Gives each of the model's sparse layers the C path; returns how many took it."""
    layers = sparse_layers(model)
    for moe in layers.values():
        moe.fused = CpuFusedExperts(kernels, moe)
    return len(layers)
