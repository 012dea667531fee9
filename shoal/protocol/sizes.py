"""Byte sizes as people write them (2GiB, 512M) and back."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'2GiB', '512M', '1073741824' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (try 2GiB or 512MiB)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def format_size(n: int) -> str:
    """2147483648 -> '2GiB' (the largest unit that divides it)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)
