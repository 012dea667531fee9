"""Usage accounting: the tenants' counts in memory, written to the usage store every few seconds
and when the gateway stops, and the totals an operator bills from (`/fleet/usage`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from shoal.fleet.admission.tenants import Tenants
from shoal.fleet.admission.usage_store import UsageStore

log = logging.getLogger(__name__)

USAGE_WRITE_INTERVAL_S = 2.0


class UsageLedger:
    def __init__(self, tenants: Tenants):
        self.tenants = tenants
        self.store: UsageStore | None = None
        self._task: asyncio.Task | None = None

    async def start(self, where: Path) -> None:
        self.store = await asyncio.to_thread(UsageStore, where / "usage.sqlite3")
        self._task = asyncio.get_running_loop().create_task(self._write_every())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.store is not None:
            await asyncio.to_thread(self.store.write, self.tenants.counts())
            self.store.close()

    def report(self) -> dict[str, Any]:
        """Usage totals by tenant and lane: stored ones and this process's."""
        counts = self.tenants.counts()
        totals = self.store.totals(counts) if self.store is not None else counts
        out: dict[str, dict] = {}
        for (tenant, lane), u in sorted(totals.items()):
            out.setdefault(tenant, {})[lane] = u.as_dict()
        return {"object": "list", "tenants": out}

    async def _write_every(self) -> None:
        while True:
            await asyncio.sleep(USAGE_WRITE_INTERVAL_S)
            try:
                await asyncio.to_thread(self.store.write, self.tenants.counts())
            except Exception:  # a full disk must not stop the gateway; the next write retries
                log.exception("could not write usage totals")
