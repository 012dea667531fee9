"""Compiles the C kernels on first use and caches the shared library.

The kernels are plain C files with no dependencies, so a system C compiler builds them in under
a second; there is no build step at install time and no torch headers involved. The library is
cached under SHOAL_CACHE_DIR (default ~/.cache/shoal), keyed by the source, flags and compiler.
Where the CPU lacks AVX2/FMA or no compiler is found, callers fall back to plain torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from shoal.cache_dir import cache_root
from shoal.kernels.abi import CPU_CONSTANTS, CPU_STRUCTS, SHM_STRUCTS, open_checked

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "cpu_quant.c",
        "cpu_x8.c",
        "cpu_amx.c",
        "cpu_int8.c",
        "cpu_f32.c",
        "cpu_ops.c",
        "cpu_lora.c",
        "cpu_layer.c",
        "abi.c",
    )
]
ABI_HEADER = Path(__file__).with_name("shoal_abi.h")  # what both libraries share with Python
HEADERS = [Path(__file__).with_name("simd.h"), ABI_HEADER]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
# Where the CPU has them, byte dot products run on AVX-512 VNNI (vpdpbusd) instead of two AVX2 ops.
VNNI_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
# Where it also has AMX, batches of 16 rows and more (Q4_1; Q8_0 from 8) multiply on its tiles
# (cpu_amx.c).
AMX_CPU_FLAGS = {"amx_tile", "amx_int8"}
AMX_FLAGS = ("-mamx-tile", "-mamx-int8")
REQUIRED_CPU_FLAGS = {"avx2", "fma", "f16c"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty off x86-64 Linux)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags_line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(flags_line.split(":", 1)[-1].split())


def cpu_supports_kernels() -> bool:
    return cpu_flags() >= REQUIRED_CPU_FLAGS


def compile_flags() -> list[str]:
    """SHOAL_KERNELS_AVX2_ONLY=1 builds the AVX2 variant even where VNNI is present, and
    SHOAL_KERNELS_NO_AMX=1 the VNNI one where AMX is (for tests, or a cache shared with older CPUs)."""
    vnni = cpu_flags() >= VNNI_CPU_FLAGS and not os.environ.get("SHOAL_KERNELS_AVX2_ONLY")
    amx = vnni and cpu_flags() >= AMX_CPU_FLAGS and not os.environ.get("SHOAL_KERNELS_NO_AMX")
    amx = amx and compiler_accepts(AMX_FLAGS)
    return FLAGS + (VNNI_FLAGS if vnni else []) + (list(AMX_FLAGS) if amx else [])


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)


@functools.cache
def compiler_accepts(flags: tuple[str, ...]) -> bool:
    """Whether the C compiler knows these flags (AMX needs GCC 11 or Clang 12)."""
    cc = _compiler()
    probe = subprocess.run(
        [cc, *flags, "-x", "c", "-c", "-o", os.devnull, "-"], input="int x;", capture_output=True, text=True
    )
    return probe.returncode == 0


def kernels_cache_dir() -> Path:
    return (cache_root() or Path(tempfile.gettempdir()) / "shoal-kernels") / "kernels"


@functools.cache
def cpu_model_name() -> str:
    """/proc/cpuinfo's model name ("AMD EPYC 7B13"), or the platform's processor string."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _unavailable_reason() -> str | None:
    if os.environ.get("SHOAL_NO_KERNELS"):
        return "SHOAL_NO_KERNELS is set"
    if not cpu_supports_kernels():
        return f"this CPU lacks {sorted(REQUIRED_CPU_FLAGS)}"
    if _compiler() is None:
        return "no C compiler found (set CC); quantized layers run in plain torch"
    return None


@functools.cache
def kernel_library_key() -> str | None:
    """What the library is built from (sources, flags, compiler), or None where it cannot be built."""
    if _unavailable_reason() is not None:
        return None
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    return hashlib.sha256(source + " ".join([cc, *compile_flags(), version]).encode()).hexdigest()[:16]


def cpu_library_path() -> Path | None:
    """Where the CPU kernels are built (compiled on first call), or None where they cannot be."""
    reason = _unavailable_reason()
    if reason is not None:
        log.log(logging.WARNING if "compiler" in reason else logging.INFO, "CPU kernels off: %s", reason)
        return None
    target = kernels_cache_dir() / f"libshoal_cpu-{kernel_library_key()}.so"
    return target if _compile(target, compile_flags(), SOURCES) else None


@functools.cache
def load_cpu_library() -> ctypes.CDLL | None:
    """The compiled CPU kernels, or None where they cannot run here or their ABI is not the one
    Python builds (the reason is logged)."""
    target = cpu_library_path()
    if target is None:
        return None
    # torch is imported first, so the library's libgomp resolves to torch's OpenMP runtime and the
    # two share one thread pool.
    import torch  # noqa: F401

    lib = open_checked(str(target), CPU_STRUCTS, CPU_CONSTANTS)
    if lib is not None and "-mamx-int8" in compile_flags():
        # Linux hands out the tiles' 8 KB of register state only on request; without it the kernels
        # keep to AVX-512.
        log.info("AMX tiles %s", "on" if lib.shoal_amx_enable() else "refused by the kernel")
    return lib


SHM_SOURCES = [Path(__file__).with_name(n) for n in ("shm_comm.c", "abi.c")]
SHM_FLAGS = ["-O3", "-shared", "-fPIC"]


@functools.cache
def load_shm_library() -> ctypes.CDLL | None:
    """The shared-memory collectives (plain C, any CPU), or None without a compiler."""
    cc = _compiler()
    if cc is None or os.environ.get("SHOAL_NO_KERNELS"):
        return None
    source = b"".join(p.read_bytes() for p in [*SHM_SOURCES, ABI_HEADER])
    key = hashlib.sha256(source + " ".join([cc, *SHM_FLAGS]).encode()).hexdigest()[:16]
    target = kernels_cache_dir() / f"libshoal_shm-{key}.so"
    return open_checked(str(target), SHM_STRUCTS) if _compile(target, SHM_FLAGS, SHM_SOURCES) else None


def _compile(target: Path, flags: list[str], sources: list[Path]) -> bool:
    if target.exists():
        return True
    cc = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    proc = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources)], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        log.warning("%s failed to build: %s", target.name, proc.stderr[-2000:])
        return False
    os.replace(tmp, target)  # atomic, so concurrent first starts do not load a half-written file
    return True
