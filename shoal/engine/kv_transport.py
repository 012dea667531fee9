"""How a packed request's K/V moves between workers: one frame per request (a JSON header with
its token count, block hashes, shape and dtype, then the raw tensor bytes), carried either in a
shared-memory file on the same host or in the body of a TCP (HTTP) response between hosts.

NIXL (RDMA between GPUs' memory) is named but not built: it needs GPU K/V pools registered with
its agent, which this CPU build has no way to exercise. Asking for it is an error that says so
(and whether the package is there), never a silent fallback to another transport."""

from __future__ import annotations

import json
import math
import os
import socket
import struct
from pathlib import Path

import numpy as np
import torch

from shoal.engine.kv_transfer import PackedKV
from shoal.protocol.kv_files import SHM_DIR, SHM_NAME, new_name, shm_available, shm_unlink

TRANSPORTS = ("auto", "shm", "tcp", "nixl")
_HEADER = struct.Struct("<I")
MAX_HEADER_BYTES = 16 << 20
DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class TransferError(Exception):
    """The K/V could not be moved or does not parse; the receiver computes the prompt itself."""


def host_id() -> str:
    """Same on two workers exactly when they share a machine (and so its shared memory)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def nixl_available() -> bool:
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True


def check_transport(name: str) -> None:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose from {', '.join(TRANSPORTS)}")
    if name == "nixl":
        have = "installed" if nixl_available() else "not installed"
        raise ValueError(
            f"the nixl KV transport is not built yet (the nixl package is {have}); use shm or tcp"
        )
    if name == "shm" and not shm_available():
        raise ValueError(f"the shm KV transport needs a writable {SHM_DIR}")


def choose(setting: str, peer_host: str | None) -> str:
    """The transport for a pull from a peer: shared memory when it is on this host."""
    if setting != "auto":
        return setting
    return "shm" if peer_host == host_id() and shm_available() else "tcp"


# --- the frame -----------------------------------------------------------------------------


def _raw(data: torch.Tensor) -> np.ndarray:
    return data.contiguous().reshape(-1).view(torch.uint8).numpy()


def header(packed: PackedKV) -> bytes:
    meta = {
        "num_tokens": packed.num_tokens,
        "block_hashes": list(packed.block_hashes),
        "shape": list(packed.data.shape),
        "dtype": str(packed.data.dtype),
    }
    body = json.dumps(meta).encode()
    body += b" " * (-(_HEADER.size + len(body)) % 64)  # the tensor starts aligned
    return _HEADER.pack(len(body)) + body


def encode(packed: PackedKV) -> bytes:
    return header(packed) + _raw(packed.data).tobytes()


def decode(buf: bytearray) -> PackedKV:
    """A frame back to PackedKV; its tensor is a view of `buf` (which it keeps alive)."""
    view = memoryview(buf)
    if len(view) < _HEADER.size:
        raise TransferError("the K/V frame is truncated")
    (n,) = _HEADER.unpack_from(view)
    if n > MAX_HEADER_BYTES or _HEADER.size + n > len(view):
        raise TransferError("the K/V frame's header is truncated or too large")
    try:
        meta = json.loads(bytes(view[_HEADER.size : _HEADER.size + n]))
        shape = [int(s) for s in meta["shape"]]
        dtype = DTYPES[meta["dtype"]]
        num_tokens = int(meta["num_tokens"])
        hashes = [int(h) for h in meta["block_hashes"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise TransferError(f"the K/V frame's header does not parse: {exc}") from None
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    held = len(view) - _HEADER.size - n
    if len(shape) != 5 or min(shape) < 0 or held != size:
        raise TransferError(f"the K/V frame holds {held} bytes; its header says {size}")
    if size == 0:
        return PackedKV(num_tokens, hashes, torch.empty(shape, dtype=dtype))
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=_HEADER.size + n)
    return PackedKV(num_tokens, hashes, flat.view(dtype).reshape(shape))


# --- shared memory -------------------------------------------------------------------------


def shm_write(packed: PackedKV) -> str:
    """Writes the frame to a new shared-memory file only this user can read; returns its name."""
    name = new_name()
    fd = os.open(SHM_DIR / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header(packed))
            f.write(memoryview(_raw(packed.data)))
    except BaseException:
        shm_unlink(name)
        raise
    return name


def shm_read(name: str) -> PackedKV:
    if not isinstance(name, str) or not SHM_NAME.fullmatch(name):
        raise TransferError("not a shared-memory K/V name this worker reads")
    try:
        with open(SHM_DIR / name, "rb") as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            if f.readinto(buf) != len(buf):
                raise TransferError("the shared-memory K/V was cut short")
    except OSError as exc:
        raise TransferError(f"the shared-memory K/V could not be read: {exc}") from None
    return decode(buf)
