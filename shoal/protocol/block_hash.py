"""Chained block hashes: a full block's hash covers its parent's hash, its tokens and extra keys.

Pure Python and stable across processes. It lives outside the engine because the fleet router
hashes prompts exactly as the engine does, and the router must not import the engine.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

NONE_HASH = 0


def root_hash(salt: bytes) -> int:
    """The parent of a chain's first block. A deployment's secret salt makes hashes of public token
    ids unguessable to anyone who reads a KV-event feed without the salt."""
    if not salt:
        return NONE_HASH
    return int.from_bytes(hashlib.sha256(b"shoal kv salt\0" + salt).digest()[:8], "little")


def adapter_keys(adapter: str | None) -> tuple:
    """The extra keys of a block computed under a LoRA adapter: its K/V is the adapter's own, so
    its hash covers the adapter (the engine's blocks and the router's guesses alike)."""
    return () if adapter is None else (("lora", adapter),)


def hash_block(parent: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    h = hashlib.sha256((parent or NONE_HASH).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest()[:8], "little")


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    known: list[int] | None = None,
    root: int = NONE_HASH,
) -> list[int]:
    """Hashes every full block of `token_ids`, reusing (and extending) the `known` prefix of hashes.
    `root` (see `root_hash`) is the first block's parent."""
    hashes = known if known is not None else []
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys))
    return hashes
