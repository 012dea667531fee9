"""Seed derivation shared by every process that samples: stable across processes and versions."""

from __future__ import annotations

import hashlib

SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 63) - 1


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed from a client's seed (any int64) and integer keys (choice index, position).
    Hashing keeps every derived value in range whatever the inputs, and makes the draw for one
    position independent of how many draws came before it, so a stream resumed elsewhere draws
    the same tokens."""
    h = hashlib.blake2b(digest_size=8)
    for k in (seed, *keys):
        h.update((k & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") >> 1
