"""One request's packed K/V as one frame: a JSON header with its token count, block hashes,
shape and dtype, then the raw tensor bytes (aligned to 64 bytes)."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import torch

from shoal.engine.kv_connector.packing import PackedKV

_HEADER = struct.Struct("<I")
MAX_HEADER_BYTES = 16 << 20
DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class TransferError(Exception):
    """The K/V could not be moved or does not parse; the receiver computes the prompt itself."""


def raw(data: torch.Tensor) -> np.ndarray:
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
    return header(packed) + raw(packed.data).tobytes()


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
