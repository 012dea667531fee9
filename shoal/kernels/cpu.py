"""torch-facing wrappers of the C kernels (formats and semantics are in the C files)."""

from __future__ import annotations

import ctypes
import functools

import torch

from shoal.kernels.abi import (
    FORMAT_F32_ROWS,
    FORMAT_INT8_ROWS,
    FORMAT_Q4_1,
    FORMAT_Q4_1X8,
    FORMAT_Q8_0,
    FORMAT_Q8_0X8,
    KV_BF16,
    KV_F16,
    KV_F32,
    LORA_F16,
    LORA_F32,
    LORA_MAX_RANK,
    LORA_MAX_SLOTS,
    LayerParams,
    LoRAParams,
)
from shoal.kernels.build import load_cpu_library
from shoal.kernels.tuning import KernelChoices, KernelTuner

QK = 32  # values per quantized block


def decode_attention_supports(head_dim: int) -> bool:
    """Whether shoal_paged_decode_attention takes this head size."""
    return head_dim <= 256 and head_dim % 8 == 0


# q4_1x8, q8_0x8: the same blocks repacked 8 rows at a time (cpu_x8.c)
BLOCK_FORMAT_IDS = {
    "q4_1": FORMAT_Q4_1,
    "q8_0": FORMAT_Q8_0,
    "q4_1x8": FORMAT_Q4_1X8,
    "q8_0x8": FORMAT_Q8_0X8,
}
# Element types of the KV cache the C attention reads and the fused layer writes.
KV_TYPE_IDS = {torch.float32: KV_F32, torch.float16: KV_F16, torch.bfloat16: KV_BF16}
INT8_ROWS_FORMAT_ID = FORMAT_INT8_ROWS  # int8 weights with one scale per output row (cpu_int8.c)
F32_ROWS_FORMAT_ID = FORMAT_F32_ROWS  # float32 weights (cpu_f32.c)
LORA_DTYPE_IDS = {torch.float32: LORA_F32, torch.float16: LORA_F16}  # adapter weights (cpu_lora.c)

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float

_SIGNATURES = {
    "shoal_block_linear": [ctypes.c_int, _P, _I, _I, _P, _P, _P, _P, _P, _P, _I, _P],
    "shoal_int8_linear": [_P, _I, _I, _P, _P, _P, _P, _I, _P],
    "shoal_f32_linear": [_P, _I, _I, _P, _I, _P],
    "shoal_quantize_rows": [_P, _I, _I, _P, _P],
    "shoal_int8_rescale": [_P, _P, _P, _I, _I, _P],
    "shoal_add_rms_norm": [_P, _P, _P, _I, _I, _F, _P],
    "shoal_silu_mul": [_P, _I, _I, _P],
    "shoal_decode_layer": [ctypes.POINTER(LayerParams), _P, _P, _I, _P, _P, _P, _P, _I, _P, _P, _P, _P],
    "shoal_lora_apply": [ctypes.POINTER(LoRAParams), _P, _I, _P, _P, _I],
    "shoal_decode_layer_scratch": [ctypes.POINTER(LayerParams), _I],
    "shoal_moe_experts_scratch": [_I, _I, _I],
    "shoal_moe_experts": [_P, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P],
    "shoal_paged_decode_attention": [_P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _I, _P],
}


class CpuKernels:
    """Every tensor passed in must be a contiguous float32 (or the stated type) CPU tensor."""

    def __init__(self, lib: ctypes.CDLL):
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        lib.shoal_decode_layer_scratch.restype = ctypes.c_int64
        lib.shoal_moe_experts_scratch.restype = ctypes.c_int64
        self._moe_experts = lib.shoal_moe_experts
        self._moe_experts_scratch = lib.shoal_moe_experts_scratch
        self._decode_layer = lib.shoal_decode_layer
        self._decode_layer_scratch = lib.shoal_decode_layer_scratch
        self._block_linear = lib.shoal_block_linear
        self._int8_linear = lib.shoal_int8_linear
        self._f32_linear = lib.shoal_f32_linear
        self._quantize_rows = lib.shoal_quantize_rows
        self._int8_rescale = lib.shoal_int8_rescale
        self._add_rms_norm = lib.shoal_add_rms_norm
        self._silu_mul = lib.shoal_silu_mul
        self._decode_attention = lib.shoal_paged_decode_attention
        self._lora_apply = lib.shoal_lora_apply
        self.tuner = KernelTuner(self)  # it times these kernels

    @property
    def choices(self) -> KernelChoices:
        """Which path is fastest on this CPU at each batch size (measured once, then cached)."""
        return self.tuner.choices()

    def block_linear(
        self, fmt: str, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, mn: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] times block-quantized W [N, K] transposed (activations quantized to int8 blocks)."""
        m, k = x.shape
        n = d.numel() // (k // QK)  # one scale per block of every output row, whatever the layout
        xq = torch.empty((m, k), dtype=torch.int8)
        scales = torch.empty((2, m, k // QK), dtype=torch.float32)
        y = torch.empty((m, n), dtype=torch.float32)
        self._block_linear(
            BLOCK_FORMAT_IDS[fmt], x.data_ptr(), m, k, xq.data_ptr(), scales[0].data_ptr(),
            scales[1].data_ptr(), qs.data_ptr(), d.data_ptr(), 0 if mn is None else mn.data_ptr(), n,
            y.data_ptr(),
        )  # fmt: skip
        return y

    def int8_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [M, K] times int8 w [N, K] (scale [N] per row) transposed, with x rounded to int8 per row;
        bit-identical to torch._int_mm on the same rounding (see cpu_int8.c). K % 32 == 0."""
        m, k = x.shape
        n = w.shape[0]
        xq = torch.empty((m, k), dtype=torch.int8)
        xs = torch.empty(m, dtype=torch.float32)
        y = torch.empty((m, n), dtype=torch.float32)
        self._int8_linear(
            x.data_ptr(), m, k, xq.data_ptr(), xs.data_ptr(), w.data_ptr(), scale.data_ptr(), n, y.data_ptr()
        )
        return y

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (int8 [M, K], scale [M, 1]) rounded as Int8Linear does. K % 32 == 0."""
        m, k = x.shape
        xq = torch.empty((m, k), dtype=torch.int8)
        xs = torch.empty((m, 1), dtype=torch.float32)
        self._quantize_rows(x.data_ptr(), m, k, xq.data_ptr(), xs.data_ptr())
        return xq, xs

    def int8_rescale(self, acc: torch.Tensor, xs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """acc [M, N] int32 * xs [M, 1] * scale [N], as float32 in that order, in one pass."""
        m, n = acc.shape
        y = torch.empty((m, n), dtype=torch.float32)
        self._int8_rescale(acc.data_ptr(), xs.data_ptr(), scale.data_ptr(), m, n, y.data_ptr())
        return y

    def f32_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w [N, K] transposed."""
        m, k = x.shape
        y = torch.empty((m, w.shape[0]), dtype=torch.float32)
        self._f32_linear(x.data_ptr(), m, k, w.data_ptr(), w.shape[0], y.data_ptr())
        return y

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta in place (when given), then returns rms_norm(x) * weight. x: [M, H]."""
        m, h = x.shape
        out = torch.empty_like(x)
        self._add_rms_norm(
            x.data_ptr(),
            0 if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            m,
            h,
            eps,
            out.data_ptr(),
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        m, two_i = gate_up.shape
        out = torch.empty((m, two_i // 2), dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), m, two_i // 2, out.data_ptr())
        return out

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        block_size: int,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        """q [B, Hq, D] (heads and dims contiguous, rows at any stride); caches [slots, Hk, D]; tables
        [B, W] and lens [B] int64. Returns [B, Hq, D]."""
        b, hq, dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != dim:
            q = q.contiguous()
        out = torch.empty((b, hq, dim), dtype=torch.float32)
        self._decode_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), b, hq, k_cache.shape[1], dim, block_size, window or 0, scale,
            KV_TYPE_IDS[k_cache.dtype], out.data_ptr(),
        )  # fmt: skip
        return out

    @staticmethod
    def lora_params(a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, offset: int = 0) -> LoRAParams:
        """One target module's adapter slots as the C kernels read them: a [S, R, k] and b [S, R, n]
        float32 or float16, ranks [S] int64 (the tensors must outlive the result)."""
        if a.shape[1] > LORA_MAX_RANK or a.shape[0] > LORA_MAX_SLOTS:
            raise ValueError(f"the kernels take LoRA ranks to {LORA_MAX_RANK} and {LORA_MAX_SLOTS - 1} slots")
        if a.dtype not in LORA_DTYPE_IDS or b.dtype != a.dtype:
            raise ValueError(f"the kernels take LoRA weights in float32 or float16, not {a.dtype}")
        return LoRAParams(
            k=a.shape[2], n=b.shape[2], max_rank=a.shape[1], offset=offset, slots=a.shape[0],
            dtype=LORA_DTYPE_IDS[a.dtype], a=a.data_ptr(), b=b.data_ptr(), ranks=ranks.data_ptr(),
        )  # fmt: skip

    def lora_apply(
        self, params: LoRAParams, x: torch.Tensor, row_slots: torch.Tensor, y: torch.Tensor
    ) -> None:
        """y[i, offset:offset+n] += B[s] @ (A[s] @ x[i]) for each row i with slot s = row_slots[i] > 0,
        in place. x [M, k] float32 contiguous, row_slots [M] int64, y [M, *] contiguous."""
        self._lora_apply(
            ctypes.byref(params), x.data_ptr(), x.shape[0], row_slots.data_ptr(), y.data_ptr(), y.shape[1]
        )

    def decode_layer_scratch(self, params: LayerParams, rows: int) -> int:
        """Bytes of scratch `decode_layer` needs for `rows` rows."""
        return self._decode_layer_scratch(ctypes.byref(params), rows)

    def decode_layer(
        self,
        params: LayerParams,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        scratch: torch.Tensor,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder layer for single-token rows (see cpu_layer.c): x [M, hidden] gets delta added
        in place; returns this layer's output [M, hidden]. cos/sin [M, D]; slots, tables, lens int64;
        scratch: at least decode_layer_scratch(params, M) bytes, 64-byte aligned; lora_slots [M]
        int64: each row's adapter slot (None: no row has one)."""
        out = torch.empty_like(x)
        lora = 0 if lora_slots is None else lora_slots.data_ptr()
        self._decode_layer(
            ctypes.byref(params), x.data_ptr(), 0 if delta is None else delta.data_ptr(), x.shape[0],
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), lora, scratch.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return out

    def moe_experts(
        self,
        gate_up,
        down,
        intermediate: int,
        x: torch.Tensor,
        rows: torch.Tensor,
        scale: torch.Tensor | None,
        starts: torch.Tensor,
        ends: torch.Tensor,
    ) -> torch.Tensor:
        """A mixture of experts' routed part (see cpu_layer.c): gate_up, down: ctypes arrays of
        ProjectionParams, one per expert; x [T, H]; rows, starts, ends int64; scale float32 or
        None. Returns [T, H]."""
        hidden = x.shape[1]
        widest = int((ends - starts).max()) if len(starts) else 0
        scratch = torch.empty(self._moe_experts_scratch(widest, hidden, intermediate) + 64, dtype=torch.uint8)
        base = scratch.data_ptr()
        out = torch.zeros_like(x)
        self._moe_experts(
            ctypes.addressof(gate_up), ctypes.addressof(down), len(starts), hidden, intermediate,
            x.data_ptr(), rows.data_ptr(),
            0 if scale is None else scale.data_ptr(), starts.data_ptr(), ends.data_ptr(),
            base + (-base % 64), out.data_ptr(),
        )  # fmt: skip
        return out


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    lib = load_cpu_library()
    return None if lib is None else CpuKernels(lib)


def kernels_for(*tensors: torch.Tensor) -> CpuKernels | None:
    """The kernels when every tensor is a contiguous float32 CPU tensor, else None (use torch)."""
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return None
    return cpu_kernels()
