"""Weight quantization of the linear layers.

- ``int8``: symmetric int8 per output channel. On CPU the activations are quantized per token at
  run time; the product runs on torch's exact int8 matmul (``torch._int_mm``) for batches, and on a
  C kernel that gives the same bits for a few rows, where torch's per-call cost dominates.
  Elsewhere the weights are dequantized per call. down_proj alone uses Q8_0 blocks (below).
- ``int4``: GGUF's Q4_1 blocks (32 values, a scale and a minimum each), with the output head in
  Q8_0. A GGUF file's own Q4_0/Q4_1/Q8_0 tensors are used as stored, never dequantized and
  requantized. On an AVX2 CPU the C kernels in ``shoal.kernels`` run them; elsewhere they are
  dequantized per call. The fewest bytes, and the closest to fp32 on the bundled model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels.cpu import QK, cpu_kernels
from shoal.models.llama import PACKED_PARTS

QUANT_METHODS = ("int8", "int4")
# What --quantization takes: a method, "none" (the checkpoint's weights unquantized: the fp32
# reference), or "auto".
QUANT_CHOICES = ("auto", "none", *QUANT_METHODS)
BLOCK_FORMATS = ("q4_1", "q8_0")


@dataclass
class BlockWeights:
    """A [N, K] weight in blocks of 32 along K. q4_1: qs [N, K/32, 16] uint8 nibbles (low nibble is
    element j, high is element j + 16) and mn; q8_0: qs [N, K] int8, mn None. d, mn: [N, K/32]."""

    format: str
    qs: torch.Tensor
    d: torch.Tensor
    mn: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.d.shape[1] * QK

    def select_rows(self, index: torch.Tensor) -> BlockWeights:
        mn = None if self.mn is None else self.mn[index]
        return BlockWeights(self.format, self.qs[index], self.d[index], mn)

    def to(self, device: str | torch.device) -> BlockWeights:
        mn = None if self.mn is None else self.mn.to(device)
        return BlockWeights(self.format, self.qs.to(device), self.d.to(device), mn)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        if self.format == "q4_1":
            q = torch.cat([self.qs & 0x0F, self.qs >> 4], dim=-1).float()
            return (q * self.d[..., None] + self.mn[..., None]).reshape(n, k)
        return (self.qs.view(n, -1, QK).float() * self.d[..., None]).reshape(n, k)


def quantize_q4_1(w: torch.Tensor) -> BlockWeights:
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // QK, QK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = (hi - lo) / 15
    q = ((blocks - lo[..., None]) / torch.where(d > 0, d, 1)[..., None]).round().clamp(0, 15).to(torch.uint8)
    return BlockWeights("q4_1", q[..., :16] | (q[..., 16:] << 4), d, lo)


def symmetric_int8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds each row of the last dimension to int8 in [-127, 127]; returns (int8, scale per row)."""
    v = values.detach().float()
    scale = v.abs().amax(-1) / 127
    # |v| / scale <= 127, so no clamp is needed; in-place rounding keeps this a small part of startup.
    q = torch.div(v, torch.where(scale > 0, scale, 1)[..., None]).round_().to(torch.int8)
    return q, scale


def quantize_q8_0(w: torch.Tensor) -> BlockWeights:
    n, k = w.shape
    q, d = symmetric_int8(w.reshape(n, k // QK, QK))
    return BlockWeights("q8_0", q.reshape(n, k), d)


class _QuantLinear(nn.Module):
    """The shape and bias handling common to the quantized linear layers."""

    def __init__(self, bias: torch.Tensor | None):
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._matmul(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ W^T [M, N] in x's dtype."""
        raise NotImplementedError


# Block formats repacked 8 rows at a time (cpu_x8.c), and the bytes each row's block takes.
REPACKED = {"q4_1": "q4_1x8", "q8_0": "q8_0x8"}
_BLOCK_BYTES = {"q4_1": 16, "q8_0": 32}


def repack_x8(w: BlockWeights) -> BlockWeights:
    """Blocks of 8 consecutive rows interleaved in 4-byte groups, as cpu_x8.c reads them: qs
    [N/8, K/32, bytes/4, 8, 4], d and mn [N/8, K/32, 8]. N % 8 == 0."""
    n, k = w.shape
    g, nbytes = k // QK, _BLOCK_BYTES[w.format]
    qs = w.qs.reshape(n // 8, 8, g, nbytes // 4, 4).permute(0, 2, 3, 1, 4).contiguous()

    def per_tile(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(n // 8, 8, g).permute(0, 2, 1).contiguous()

    return BlockWeights(REPACKED[w.format], qs, per_tile(w.d), per_tile(w.mn))


def unpack_x8(w: BlockWeights) -> BlockWeights:
    """The row-major blocks of a repacked weight (the inverse of repack_x8)."""
    fmt = next(f for f, packed in REPACKED.items() if packed == w.format)
    tiles, g = w.d.shape[:2]
    qs = w.qs.permute(0, 3, 1, 2, 4).reshape(tiles * 8, g, _BLOCK_BYTES[fmt])
    if fmt == "q8_0":
        qs = qs.reshape(tiles * 8, g * QK)

    def per_row(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.permute(0, 2, 1).reshape(tiles * 8, g)

    return BlockWeights(fmt, qs, per_row(w.d), per_row(w.mn))


class BlockQuantLinear(_QuantLinear):
    """y = x @ W^T with W held in Q4_1 or Q8_0 blocks. Where the CPU kernels run it, the blocks are
    held repacked 8 rows at a time (formats "q4_1x8", "q8_0x8"), which they multiply fastest."""

    def __init__(self, weights: BlockWeights, bias: torch.Tensor | None = None):
        super().__init__(bias)
        if weights.format not in BLOCK_FORMATS:
            raise ValueError(f"unknown block format {weights.format!r}")
        self.out_features, self.in_features = weights.shape
        weights = BlockWeights(
            weights.format, weights.qs, weights.d.float(), None if weights.mn is None else weights.mn.float()
        )
        on_cpu_kernels = weights.qs.device.type == "cpu" and cpu_kernels() is not None
        if self.out_features % 8 == 0 and on_cpu_kernels:
            weights = repack_x8(weights)
        self.format = weights.format
        self.register_buffer("qs", weights.qs.contiguous())
        self.register_buffer("d", weights.d.contiguous())
        self.register_buffer("mn", None if weights.mn is None else weights.mn.contiguous())

    @property
    def weights(self) -> BlockWeights:
        """The weights in GGUF's row-major block layout."""
        w = BlockWeights(self.format, self.qs, self.d, self.mn)
        return unpack_x8(w) if self.format in REPACKED.values() else w

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels() if x.device.type == "cpu" else None
        if kernels is None:
            return F.linear(x, self.weights.dequantize().to(x.dtype))
        y = kernels.block_linear(self.format, x.float().contiguous(), self.qs, self.d, self.mn)
        return y.to(x.dtype)


class Int8Linear(_QuantLinear):
    """y = x @ W^T with W in int8, one scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(bias)
        q, scale = symmetric_int8(weight)
        self.out_features, self.in_features = q.shape
        # Stored [K, N] (a transposed view of [N, K]): the layout torch._int_mm reads fastest here.
        self.register_buffer("weight_t", q.t())
        self.register_buffer("scale", scale)

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight as [N, K] (contiguous: weight_t is its transposed view)."""
        return self.weight_t.t()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, (self.weight.to(x.dtype) * self.scale[:, None].to(x.dtype)))
        kernels = cpu_kernels()
        if kernels is not None and self.in_features % QK == 0:
            x32 = x.float().contiguous()
            if not kernels.choices.int8_uses_torch(x.shape[0]):
                return kernels.int8_linear(x32, self.weight, self.scale).to(x.dtype)
            xq, xs = kernels.quantize_rows(x32)
            return kernels.int8_rescale(torch._int_mm(xq, self.weight_t), xs, self.scale).to(x.dtype)
        xf = x.float()
        # Per-token scales keep each row's result independent of what else is in the batch.
        xs = xf.abs().amax(1, keepdim=True).clamp_(min=1e-12).div_(127)
        xq = (xf / xs).round_().to(torch.int8)
        return (torch._int_mm(xq, self.weight_t) * xs * self.scale).to(x.dtype)


def resolve_quantization(requested: str | None, stored_formats: dict[str, str]) -> str | None:
    """The method to load with (None: unquantized). "auto" runs a GGUF as stored: int4 when most of
    its projections are Q4 blocks, int8 when they are Q8_0; any other checkpoint is left as it is."""
    if requested in (None, "none"):
        return None
    if requested != "auto":
        if requested not in QUANT_METHODS:
            raise ValueError(f"unknown quantization {requested!r}; choose from {list(QUANT_CHOICES)}")
        return requested
    formats = [fmt for name, fmt in stored_formats.items() if ".layers." in name]
    if not formats:
        return None
    majority = max(set(formats), key=formats.count)
    return "int4" if majority == "q4_1" else "int8"


def quantize_model(model: nn.Module, method: str, stored: dict[str, BlockWeights] | None = None) -> None:
    """Swaps the model's projections and output head for quantized ones, in place.

    `stored`: blocks a GGUF file already holds, by HF tensor name ("model.layers.0.self_attn.q_proj
    .weight"); with int4 they are used as they are instead of requantizing the float weights.
    """
    if method not in QUANT_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {list(QUANT_METHODS)}")
    stored = stored or {}
    for i, layer in enumerate(model.layers):
        for owner, name, path in layer.projection_sites():
            linear = getattr(owner, name)
            if method == "int4":
                blocks = _stored_projection(stored, f"model.layers.{i}.{path}", name)
                setattr(owner, name, BlockQuantLinear(blocks or quantize_q4_1(linear.weight), linear.bias))
            elif name == "down_proj":
                # down_proj's input (silu(gate) * up) has outlier channels that one scale per token
                # rounds away: top-1 agreement with fp32 went from 89% to 94% with scales per block.
                setattr(owner, name, BlockQuantLinear(quantize_q8_0(linear.weight), linear.bias))
            else:
                setattr(owner, name, Int8Linear(linear.weight, linear.bias))
    if not model.shard.is_last_stage:
        return  # an earlier pipeline stage has no output head
    head = model.lm_head_weight
    if method == "int8":
        model.lm_head = Int8Linear(head)
    else:
        key = "lm_head.weight" if "lm_head.weight" in stored else "model.embed_tokens.weight"
        model.lm_head = BlockQuantLinear(stored.get(key) or quantize_q8_0(head))


def _stored_parts(stored: dict[str, BlockWeights], module: str, fused: str) -> list[str] | None:
    """The checkpoint names of a fused projection's parts, when all are stored in one format."""
    names = [f"{module}.{p}.weight" for p in PACKED_PARTS.get(fused, (fused,))]
    parts = [stored.get(n) for n in names]
    if any(p is None for p in parts) or len({p.format for p in parts}) != 1:
        return None
    return names


def stored_projection_names(model: nn.Module, stored: dict[str, BlockWeights]) -> frozenset[str]:
    """The checkpoint names of the projection weights that int4 runs from `stored` blocks as they
    are: their float copies are replaced unused, so they need not be read at all."""
    out = set()
    for i, layer in enumerate(model.layers):
        for _, name, path in layer.projection_sites():
            out.update(_stored_parts(stored, f"model.layers.{i}.{path}", name) or ())
    return frozenset(out)


def _stored_projection(stored: dict[str, BlockWeights], module: str, fused: str) -> BlockWeights | None:
    """The GGUF blocks of a fused projection of `module` ("model.layers.0.self_attn"), when all its
    parts are stored in one block format."""
    names = _stored_parts(stored, module, fused)
    if names is None:
        return None
    parts = [stored[n] for n in names]
    if len(parts) == 1:
        return parts[0]
    mn = None if parts[0].mn is None else torch.cat([p.mn for p in parts])
    return BlockWeights(
        parts[0].format, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), mn
    )
