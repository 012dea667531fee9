"""Where shoal keeps what it derives once and reuses: converted checkpoints, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path | None:
    """SHOAL_CACHE_DIR, else ~/.cache/shoal; None when SHOAL_NO_CACHE is set."""
    if os.environ.get("SHOAL_NO_CACHE"):
        return None
    return Path(os.environ.get("SHOAL_CACHE_DIR") or Path.home() / ".cache" / "shoal")


def state_root() -> Path | None:
    """Where a gateway keeps what must outlive it, unless its config says: SHOAL_STATE_DIR, else
    the cache root (a volume of its own, kept apart from what can be derived again)."""
    configured = os.environ.get("SHOAL_STATE_DIR")
    return Path(configured) if configured else cache_root()
