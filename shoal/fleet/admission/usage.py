"""Usage accounting: the tenants' counts in memory, written to the usage store every few seconds
and when the gateway stops, and the totals an operator bills from (`/fleet/usage`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from shoal.fleet.admission.shared_usage import SharedUsage, difference
from shoal.fleet.admission.tenants import Tenants, Usage
from shoal.fleet.admission.usage_store import UsageStore

log = logging.getLogger(__name__)

USAGE_WRITE_INTERVAL_S = 2.0


class UsageLedger:
    def __init__(self, tenants: Tenants, shared: SharedUsage | None = None):
        """`shared`: totals kept with every gateway's in the shared store (None: in this
        gateway's state directory)."""
        self.tenants = tenants
        self.shared = shared
        self.store: UsageStore | None = None
        self._task: asyncio.Task | None = None
        self._written: dict[tuple[str, str], Usage] = {}  # what the shared store has of ours

    async def start(self, where: Path) -> None:
        if self.shared is None:
            self.store = await asyncio.to_thread(UsageStore, where / "usage.sqlite3")
        self._task = asyncio.get_running_loop().create_task(self._write_every())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self._write()
        except Exception as exc:
            log.warning("could not write the last usage totals: %r", exc)
        if self.store is not None:
            self.store.close()

    async def _write(self) -> None:
        counts = self.tenants.counts()
        if self.shared is None:
            await asyncio.to_thread(self.store.write, counts)
            return
        now = {k: Usage(**vars(u)) for k, u in counts.items()}
        await self.shared.add(difference(now, self._written))
        self._written = now

    async def report(self) -> dict[str, Any]:
        """Usage totals by tenant and lane: stored ones and this process's."""
        counts = self.tenants.counts()
        if self.shared is not None:
            await self._write()  # what this gateway counted since its last write, then everyone's
            totals = await self.shared.totals()
        else:
            totals = self.store.totals(counts) if self.store is not None else counts
        out: dict[str, dict] = {}
        for (tenant, lane), u in sorted(totals.items()):
            out.setdefault(tenant, {})[lane] = u.as_dict()
        return {"object": "list", "tenants": out}

    async def _write_every(self) -> None:
        while True:
            await asyncio.sleep(USAGE_WRITE_INTERVAL_S)
            try:
                await self._write()
            except Exception as exc:  # a full disk or a lost store must not stop the gateway
                log.warning("could not write usage totals (the next write retries): %r", exc)
