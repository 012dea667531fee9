"""A mixture of experts' routed experts as one C call on CPU (`shoal_moe_experts` in
shoal/kernels/cpu_layer.c): the same grouping as SparseMoE.run_experts (one product per active
expert, on all of its tokens), without a round of Python and torch dispatch per expert, which at
decode sizes costs about what the expert's weights take to read. The torch path stays the
reference (tests/test_moe.py compares the two) and runs where this does not: activations that
are not float32, and float32 experts with more rows than the C kernel is faster for."""

from __future__ import annotations

import torch
from torch import nn

from shoal.engine.cpu_decode import projection_params
from shoal.kernels.abi import ProjectionParams
from shoal.kernels.cpu import CpuKernels, kernels_for
from shoal.models.moe import SparseMoE, sparse_layers
from shoal.models.quant import BlockQuantLinear, Int8Linear

RUNS_IN_C = (nn.Linear, Int8Linear, BlockQuantLinear)


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
        if self._params() is None or (self._float32 and self.kernels.choices.f32_uses_torch(widest)):
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
