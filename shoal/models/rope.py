"""Rotary position embeddings (HF "rotate_half" layout), with llama3 frequency scaling."""

from __future__ import annotations

import math

import torch

from shoal.kernels import triton_ops
from shoal.models.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type != "llama3":
        return inv
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Caches cos/sin for every position once; a step indexes them once for all layers."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling,
        freq_factors: tuple[float, ...] | None = None,
    ):
        super().__init__()
        self._args = (head_dim, max_positions, theta, scaling, freq_factors)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        # On the meta device the loader rebuilds them once the model is real; computing them on meta
        # would import torch._dynamo (through torch._refs), a second of every start.
        if torch.get_default_device().type != "meta":
            self.rebuild(torch.get_default_device())

    def rebuild(self, device: torch.device | str) -> None:
        """(Re)computes the tables on `device`; needed after building the model on the meta device."""
        head_dim, max_positions, theta, scaling, freq_factors = self._args
        inv = inverse_frequencies(head_dim, theta, scaling)
        if freq_factors is not None:
            inv = inv / torch.tensor(freq_factors, dtype=torch.float32)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        # rotate_half(x) = roll(x, D/2) with its first half negated: the sign is folded into sin.
        self.sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `positions` [T], shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [T, H, D] (HF rotate_half layout); on CUDA in place, in one fused kernel, so
        the caller must not read x again."""
        if x.stride(-1) == 1 and triton_ops.fused_ops_for(x):
            return triton_ops.rotate_(x, cos, sin)
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
