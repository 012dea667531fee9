"""Python's mirror of shoal_abi.h, and the check that a loaded library lays it out the same way.

ctypes cannot read a C header, so the structs below restate it. A restatement that drifts (a field
added in C only, a type widened) would have C read Python's memory at the wrong offsets; instead,
the library describes its own layout (abi.c: the compiler's sizeof and offsetof), and a library
whose description differs from these definitions is refused at load.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

ABI_VERSION = 2  # shoal_abi.h's SHOAL_ABI_VERSION

# Weight formats (ProjectionParams.format) and KV element types, as shoal_abi.h numbers them.
FORMAT_Q4_1 = 0
FORMAT_Q8_0 = 1
FORMAT_INT8_ROWS = 2
FORMAT_F32_ROWS = 3
FORMAT_Q4_1X8 = 4
FORMAT_Q8_0X8 = 5
KV_F32 = 0
KV_F16 = 1
KV_BF16 = 2
LORA_PARTS = 3  # the most HF modules one projection fuses (q, k, v)
LORA_MAX_RANK = 512
LORA_MAX_SLOTS = 1024  # slot 0 (no adapter) included
LORA_F32 = 0  # LoRAParams.dtype
LORA_F16 = 1

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float


class LoRAParams(ctypes.Structure):
    """One LoRA target module's adapter slots: A [slots, max_rank, k], B transposed [slots, max_rank,
    n] (float32 or float16: dtype), each slot's rank [slots] (int64), and where the module's output
    starts in its projection's."""

    _fields_ = [
        *((name, _I) for name in ("k", "n", "max_rank", "offset", "slots", "dtype")),
        *((name, _P) for name in ("a", "b", "ranks")),
    ]


class ProjectionParams(ctypes.Structure):
    """A projection's weights (a FORMAT_* id, shapes, pointers), and the adapters of the HF modules it
    fuses (lora_parts of them; 0 without adapters)."""

    _fields_ = [
        *((name, _I) for name in ("format", "n", "k")),
        *((name, _P) for name in ("qs", "d", "mn", "bias")),
        ("lora_parts", _I),
        ("lora", LoRAParams * LORA_PARTS),
    ]


class LayerParams(ctypes.Structure):
    """One decoder layer's shapes, weights and KV cache. The pointers borrow the tensors' storage:
    whoever builds this keeps those tensors alive."""

    _fields_ = [
        *((name, _I) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size")),
        ("window", _I),
        ("kv_type", _I),
        ("eps", _F),
        ("scale", _F),
        *((name, _P) for name in ("input_norm", "post_norm", "k_cache", "v_cache")),
        *((name, ProjectionParams) for name in ("qkv", "o", "gate_up", "down")),
        # Tensor parallel: the all-reduce (shm_comm.c's) applied to o_proj's and down_proj's partial
        # outputs, and its group; both 0 when the layer is whole.
        ("allreduce", _P),
        ("comm", _P),
    ]


class ShmCommState(ctypes.Structure):
    """One rank's state of the shared-memory collectives (C's ShmComm)."""

    _fields_ = [
        ("rank", _I),
        ("world", _I),
        ("base", _P),
        ("slot_bytes", _I),
        ("seq", ctypes.c_uint64),
        ("timeout_s", ctypes.c_double),
        ("failed", _I),
        ("busy_ns", _I),
        ("calls", _I),
    ]


# What each library shares with Python, by C name.
CPU_STRUCTS: dict[str, type[ctypes.Structure]] = {
    "LoRAParams": LoRAParams,
    "ProjectionParams": ProjectionParams,
    "LayerParams": LayerParams,
}
SHM_STRUCTS: dict[str, type[ctypes.Structure]] = {"ShmComm": ShmCommState}
CPU_CONSTANTS = {
    "FORMAT_Q4_1": FORMAT_Q4_1,
    "FORMAT_Q8_0": FORMAT_Q8_0,
    "FORMAT_INT8_ROWS": FORMAT_INT8_ROWS,
    "FORMAT_F32_ROWS": FORMAT_F32_ROWS,
    "FORMAT_Q4_1X8": FORMAT_Q4_1X8,
    "FORMAT_Q8_0X8": FORMAT_Q8_0X8,
    "KV_F32": KV_F32,
    "KV_F16": KV_F16,
    "KV_BF16": KV_BF16,
    "LORA_PARTS": LORA_PARTS,
    "LORA_MAX_RANK": LORA_MAX_RANK,
    "LORA_MAX_SLOTS": LORA_MAX_SLOTS,
    "LORA_F32": LORA_F32,
    "LORA_F16": LORA_F16,
}

_DESCRIBE = {
    "shoal_abi_version": [],
    "shoal_abi_sizeof": [ctypes.c_char_p],
    "shoal_abi_field_count": [ctypes.c_char_p],
    "shoal_abi_offsetof": [ctypes.c_char_p, ctypes.c_char_p],
    "shoal_abi_field_size": [ctypes.c_char_p, ctypes.c_char_p],
    "shoal_abi_constant": [ctypes.c_char_p],
}


def abi_mismatches(
    lib: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]], constants: dict[str, int] | None = None
) -> list[str]:
    """How the library's layout differs from these ctypes definitions (empty: it matches)."""
    try:
        describe = {name: getattr(lib, name) for name in _DESCRIBE}
    except AttributeError:
        return ["the library does not describe its ABI (built from older sources)"]
    for name, fn in describe.items():
        fn.argtypes, fn.restype = _DESCRIBE[name], ctypes.c_int64
    version = describe["shoal_abi_version"]()
    if version != ABI_VERSION:
        return [f"ABI version {version}, Python expects {ABI_VERSION}"]
    problems = []
    for c_name, cls in structs.items():
        t = c_name.encode()
        size = describe["shoal_abi_sizeof"](t)
        if size < 0:
            problems.append(f"{c_name}: not a type the library knows")
            continue
        if size != ctypes.sizeof(cls):
            problems.append(f"{c_name}: {size} bytes in C, {ctypes.sizeof(cls)} in Python")
        count = describe["shoal_abi_field_count"](t)
        if count != len(cls._fields_):
            problems.append(f"{c_name}: {count} fields in C, {len(cls._fields_)} in Python")
        for field_name, *_ in cls._fields_:
            f = field_name.encode()
            offset = describe["shoal_abi_offsetof"](t, f)
            ours = getattr(cls, field_name)
            if offset < 0:
                problems.append(f"{c_name}.{field_name}: no such field in C")
            elif offset != ours.offset or describe["shoal_abi_field_size"](t, f) != ours.size:
                c_size = describe["shoal_abi_field_size"](t, f)
                problems.append(
                    f"{c_name}.{field_name}: at {offset} ({c_size} bytes) in C, "
                    f"at {ours.offset} ({ours.size} bytes) in Python"
                )
    for name, value in (constants or {}).items():
        theirs = describe["shoal_abi_constant"](name.encode())
        if theirs != value:
            problems.append(f"{name}: {theirs} in C, {value} in Python")
    return problems


def open_checked(
    path: str, structs: dict[str, type[ctypes.Structure]], constants: dict[str, int] | None = None
) -> ctypes.CDLL | None:
    """The library at `path`, or None (logged) when its layout is not what Python builds."""
    lib = ctypes.CDLL(path)
    problems = abi_mismatches(lib, structs, constants)
    if problems:
        log.error("refusing %s, its ABI differs from shoal/kernels/abi.py: %s", path, "; ".join(problems))
        return None
    return lib
