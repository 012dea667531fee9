"""Usage totals per tenant and lane, kept in SQLite so that an operator can bill from them.

The gateway counts in memory and writes the totals every few seconds (and when it stops): a
kill -9 loses at most the last interval's counts, never what was written before.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from shoal.cache_dir import state_root
from shoal.fleet.admission.tenants import Usage

FIELDS = ("requests", "prompt_tokens", "completion_tokens", "rate_limited")


def state_dir(configured: str | None, port: int) -> Path | None:
    """Where this gateway keeps its state: as configured, else under the state root, per port."""
    if configured:
        return Path(configured).expanduser()
    root = state_root()
    return root / f"gateway-{port}" if root is not None else None


class UsageStore:
    def __init__(self, path: Path | str):
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.lock = threading.Lock()
        with self.lock:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS usage (tenant TEXT, lane TEXT, requests INTEGER, "
                "prompt_tokens INTEGER, completion_tokens INTEGER, rate_limited INTEGER, "
                "PRIMARY KEY (tenant, lane))"
            )
        self.base = self.load()  # totals from before this process

    def load(self) -> dict[tuple[str, str], Usage]:
        with self.lock:
            rows = self.db.execute(f"SELECT tenant, lane, {', '.join(FIELDS)} FROM usage").fetchall()
        return {(r[0], r[1]): Usage(*r[2:]) for r in rows}

    def totals(self, current: dict[tuple[str, str], Usage]) -> dict[tuple[str, str], Usage]:
        """Stored totals plus this process's counts."""
        out = {k: Usage(**vars(u)) for k, u in self.base.items()}
        for key, u in current.items():
            t = out.setdefault(key, Usage())
            for f in FIELDS:
                setattr(t, f, getattr(t, f) + getattr(u, f))
        return out

    def write(self, current: dict[tuple[str, str], Usage]) -> None:
        rows = [(k[0], k[1], *(getattr(u, f) for f in FIELDS)) for k, u in self.totals(current).items()]
        with self.lock:
            self.db.execute("BEGIN")
            self.db.executemany(
                f"INSERT OR REPLACE INTO usage VALUES (?, ?, {', '.join('?' * len(FIELDS))})", rows
            )
            self.db.execute("COMMIT")

    def close(self) -> None:
        with self.lock:
            self.db.close()
