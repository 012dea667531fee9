"""Usage totals kept in the store several gateways share: each adds what it counted since its
last write (HINCRBY, one transaction a write), so `/fleet/usage` at any gateway bills every
gateway's requests together, and a gateway that dies loses at most its last interval's counts."""

from __future__ import annotations

from shoal.fleet.admission.tenants import Usage
from shoal.fleet.admission.usage_store import FIELDS


class SharedUsage:
    def __init__(self, client, prefix: str):
        self.client = client
        self.prefix = prefix

    async def add(self, deltas: dict[tuple[str, str], Usage]) -> None:
        pipe = self.client.pipeline(transaction=True)
        for (tenant, lane), u in deltas.items():
            for f in FIELDS:
                if getattr(u, f):
                    pipe.hincrby(f"{self.prefix}{tenant}\x00{lane}", f, getattr(u, f))
        await pipe.execute()

    async def totals(self) -> dict[tuple[str, str], Usage]:
        out: dict[tuple[str, str], Usage] = {}
        async for key in self.client.scan_iter(match=f"{self.prefix}*"):
            tenant, _, lane = key.decode()[len(self.prefix) :].partition("\x00")
            row = await self.client.hgetall(key)
            out[(tenant, lane)] = Usage(*(int(row.get(f.encode(), 0)) for f in FIELDS))
        return out


def difference(now: dict[tuple[str, str], Usage], before: dict[tuple[str, str], Usage]) -> dict:
    """What `now` counts beyond `before`, by (tenant, lane)."""
    out = {}
    for key, u in now.items():
        b = before.get(key, Usage())
        d = Usage(*(getattr(u, f) - getattr(b, f) for f in FIELDS))
        if any(getattr(d, f) for f in FIELDS):
            out[key] = d
    return out
