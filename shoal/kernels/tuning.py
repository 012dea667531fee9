"""Which kernel path is fastest on this CPU, measured at first start and cached beside the kernels.

The C kernels and torch's matmuls cross over at a row count that depends on the CPU: on a Zen 4
with AVX-512 VNNI torch._int_mm overtook the C int8 kernel at ~16 rows, while on a Zen 3 with AVX2
alone it ran at 2.8 GOP/s and never did. So no crossover is a constant: the first start on a CPU
times both paths on a layer-sized product and records from how many rows torch wins, if ever.
The record is keyed by the kernel library (source, flags, compiler), the CPU model and the thread
count, so a cache shared between machines or thread settings never hands one the other's answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from shoal.kernels.build import cpu_model_name, kernel_library_key, kernels_cache_dir

log = logging.getLogger(__name__)

# Row counts timed (decode batches and small prefill chunks); past the largest, the last answer holds.
ROWS = (1, 4, 8, 16, 32, 64, 128, 256)
# A layer-sized product: hidden 576 into 1536 outputs (the bundled model's shapes are 576 to 3072).
K, N = 576, 1536
# 3: both paths timed in turn (time_pair_us); records timed one after the other are timed again.
TUNING_VERSION = 3
# A tie is no win for torch: the timed product is one matmul, but the C paths also fuse what
# surrounds it (a whole decode layer). On a 2-core Xeon a tie at one row (33.8 against 34.4 µs)
# turned the fused float32 layers off at every batch. (A MoE layer's fused experts time their own
# crossover: fused_crossover.)
TORCH_MARGIN = 0.9


class TimedKernels(Protocol):
    """The kernels whose speed is measured here (shoal.kernels.cpu.CpuKernels, which holds a tuner:
    so this module names what it times instead of importing that class)."""

    def int8_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor: ...

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def int8_rescale(self, acc: torch.Tensor, xs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor: ...

    def f32_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class KernelChoices:
    """Crossovers for this CPU: from how many rows torch's matmul beats the C kernel (None: at no
    row count measured, so the C kernel runs every batch)."""

    int8_torch_from_rows: int | None = None
    f32_torch_from_rows: int | None = 32
    cpu: str = ""
    threads: int = 0
    # Microseconds per call, by path and row count, for benchmarks to print.
    timings_us: dict[str, dict[int, float]] = field(default_factory=dict)

    def int8_uses_torch(self, rows: int) -> bool:
        return self.int8_torch_from_rows is not None and rows >= self.int8_torch_from_rows

    def f32_uses_torch(self, rows: int) -> bool:
        return self.f32_torch_from_rows is not None and rows >= self.f32_torch_from_rows

    def summary(self) -> str:
        def say(n: int | None) -> str:
            return "C kernel at every batch" if n is None else f"torch from {n} rows"

        return (
            f"{self.cpu}, {self.threads} threads: int8 {say(self.int8_torch_from_rows)}; "
            f"fp32 {say(self.f32_torch_from_rows)}"
        )


def time_pair_us(a, b, budget_s: float = 0.1, min_reps: int = 3) -> tuple[float, float]:
    """Best-of times of a and b in microseconds, taken in turn: a burst of load from another
    process then slows both alike, where timing one after the other could hand it to one alone
    (a test's server measuring on the other core once chose torch at every row)."""
    a(), b()  # warm caches and lazy initialisation
    best = [float("inf"), float("inf")]
    deadline = time.perf_counter() + budget_s
    reps = 0
    while reps < min_reps or time.perf_counter() < deadline:
        for i, fn in enumerate((a, b)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
        reps += 1
    return best[0] * 1e6, best[1] * 1e6


def _crossover(c_us: dict[int, float], torch_us: dict[int, float]) -> int | None:
    """The smallest row count from which torch is clearly faster (TORCH_MARGIN) at it and at every
    larger one measured."""
    start = None
    for rows in sorted(c_us):
        if torch_us[rows] < TORCH_MARGIN * c_us[rows]:
            start = rows if start is None else start
        else:
            start = None
    return start


def measure(kernels: TimedKernels) -> KernelChoices:
    gen = torch.Generator().manual_seed(0)
    w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    w8_t = w8.t()  # torch._int_mm reads the transposed view fastest, as Int8Linear stores it
    scale = torch.rand(N, generator=gen) / 100
    w32 = torch.randn(N, K, generator=gen)
    timings: dict[str, dict[int, float]] = {"int8_c": {}, "int8_torch": {}, "f32_c": {}, "f32_torch": {}}
    for rows in ROWS:
        x = torch.randn(rows, K, generator=gen)

        def int8_torch(x=x):
            xq, xs = kernels.quantize_rows(x)
            return kernels.int8_rescale(torch._int_mm(xq, w8_t), xs, scale)

        def int8_c(x=x):
            return kernels.int8_linear(x, w8, scale)

        # torch._int_mm wants more than 16 rows; below that only the C kernel runs.
        int8_rival = int8_torch if rows > 16 else int8_c
        timings["int8_c"][rows], timings["int8_torch"][rows] = time_pair_us(int8_c, int8_rival)
        if rows <= 16:
            timings["int8_torch"][rows] = float("inf")
        timings["f32_c"][rows], timings["f32_torch"][rows] = time_pair_us(
            lambda x=x: kernels.f32_linear(x, w32), lambda x=x: F.linear(x, w32)
        )
    return KernelChoices(
        int8_torch_from_rows=_crossover(timings["int8_c"], timings["int8_torch"]),
        f32_torch_from_rows=_crossover(timings["f32_c"], timings["f32_torch"]),
        cpu=cpu_model_name(),
        threads=torch.get_num_threads(),
        timings_us={k: {r: round(v, 1) for r, v in t.items()} for k, t in timings.items()},
    )


def _record_path() -> Path | None:
    lib = kernel_library_key()
    if lib is None:
        return None
    ident = f"{TUNING_VERSION}|{lib}|{cpu_model_name()}|{torch.get_num_threads()}"
    return kernels_cache_dir() / f"tuning-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def _load(path: Path) -> KernelChoices | None:
    try:
        raw = json.loads(path.read_text())
        raw["timings_us"] = {
            k: {int(r): v for r, v in t.items()} for k, t in raw.get("timings_us", {}).items()
        }
        return KernelChoices(**raw)
    except (OSError, ValueError, TypeError):
        return None  # absent, or written by another version: measure again


def _store(path: Path, choices: KernelChoices) -> None:
    with contextlib.suppress(OSError):  # a read-only cache costs a measurement per start, no more
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(choices), indent=1))
        os.replace(tmp, path)


class KernelTuner:
    """Loads this CPU's choices from the cache, or measures and caches them. One per process is
    enough; `choices()` is cheap after the first call."""

    def __init__(self, kernels: TimedKernels):
        self.kernels = kernels
        self._choices: dict[int, KernelChoices] = {}
        self._fused: dict[tuple, int | None] = {}

    def fused_crossover(self, key: tuple, calls_at, rows: tuple[int, ...]) -> int | None:
        """From how many rows torch beats a fused C call (None: at none of `rows`), timed once per
        process, `key` (the call's shapes) and thread count: one matmul's crossover does not say
        where a call that fuses several wins. calls_at(n): the C call and torch's, on n rows."""
        key = (*key, torch.get_num_threads())
        if key not in self._fused:
            c_us, torch_us = {}, {}
            for n in rows:
                c_us[n], torch_us[n] = time_pair_us(*calls_at(n), budget_s=0.02)
            self._fused[key] = _crossover(c_us, torch_us)
            log.info(
                "fused %s: torch from %s rows (C %s, torch %s µs)", key, self._fused[key], c_us, torch_us
            )
        return self._fused[key]

    def choices(self) -> KernelChoices:
        threads = torch.get_num_threads()
        if threads not in self._choices:
            self._choices[threads] = self._load_or_measure()
        return self._choices[threads]

    def _load_or_measure(self) -> KernelChoices:
        path = _record_path()
        found = None if path is None else _load(path)
        if found is not None:
            return found
        t0 = time.perf_counter()
        measured = measure(self.kernels)
        log.info("kernel crossovers measured in %.1f s: %s", time.perf_counter() - t0, measured.summary())
        if path is not None:
            _store(path, measured)
        return measured
