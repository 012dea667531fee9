"""Tenants' concurrency limits shared by every gateway over one store: a tenant allowed 4
requests in flight gets 4 across all of them.

Each gateway keeps its own count per tenant in one hash field (its id, new each process), and
says it is alive in a sorted set of expiry times, renewed every second. A request is admitted by
one script that sums the fields of the gateways alive and adds one to its own if the sum is
below the limit: the counts of a gateway that died (its entry expired) stop counting at once and
are removed, so a dead gateway's requests do not hold the tenant's limit. Each renewal also
writes this gateway's true counts, so a count lost with the store (a release that failed) heals
within a second. When the store cannot be reached, the gateway admits on its own counts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from shoal.fleet.admission.store import Presence, store_errors

log = logging.getLogger(__name__)

ALIVE_S = 5.0  # a gateway unheard of this long is dead
BEAT_S = 1.0

# KEYS: the tenant's counts, the gateways alive. ARGV: this gateway, the limit. Returns the
# count held across the gateways when refused, -1 when taken.
ENTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local held = 0
local counts = redis.call('HGETALL', KEYS[1])
for i = 1, #counts, 2 do
  local expiry = tonumber(redis.call('ZSCORE', KEYS[2], counts[i]) or '0')
  if expiry > now or counts[i] == ARGV[1] then
    held = held + tonumber(counts[i + 1])
  else
    redis.call('HDEL', KEYS[1], counts[i])
  end
end
if held >= tonumber(ARGV[2]) then return held end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
return -1
"""


class SharedConcurrency:
    def __init__(self, client, url: str, prefix: str):
        """`prefix`: of the keys, e.g. "shoal:concurrency:"; `url` names the store in the log."""
        self.client = client
        self.url = url
        self.prefix = prefix
        self.id = uuid.uuid4().hex
        self.errors = store_errors()
        self._enter = client.register_script(ENTER)
        self.gateways = Presence(client, prefix + "gateways")
        self._task: asyncio.Task | None = None
        self._releases: set[asyncio.Task] = set()
        self._counted: dict[str, object] = {}  # name -> tenant: those this gateway counts

    def _key(self, tenant) -> str:
        return f"{self.prefix}{tenant.name}"

    async def enter(self, tenant) -> int:
        """Takes one of the tenant's places: -1 when taken (or the store did not answer), else the
        count held across the gateways (the limit is reached)."""
        self._counted[tenant.name] = tenant
        keys = [self._key(tenant), self.gateways.key]
        try:
            return int(await self._enter(keys=keys, args=[self.id, tenant.config.max_concurrency]))
        except self.errors as exc:
            log.warning("concurrency store %s: %s; admitting on this gateway's counts", self.url, exc)
            return -1

    def leave(self, tenant) -> None:
        """Gives the place back (in the background: the answer is already on its way)."""

        async def release() -> None:
            with contextlib.suppress(*self.errors):
                await self.client.hincrby(self._key(tenant), self.id, -1)

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def start(self) -> None:
        """This gateway counts as alive from now (renewed every BEAT_S)."""
        with contextlib.suppress(*self.errors):
            await self.gateways.beat(self.id, ALIVE_S)
        self._task = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            try:
                await self.gateways.beat(self.id, ALIVE_S)
                await self._heal()
            except self.errors as exc:
                log.warning("concurrency store %s: %s", self.url, exc)

    async def _heal(self) -> None:
        """This gateway's true counts over what the store holds of them."""
        if self._releases or not self._counted:
            return
        pipe = self.client.pipeline(transaction=False)
        for t in self._counted.values():
            pipe.hset(self._key(t), self.id, t.inflight)
        await pipe.execute()

    async def stop(self) -> None:
        """This gateway's counts go, and it from the gateways alive."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(*self.errors):
            pipe = self.client.pipeline(transaction=False)
            for t in self._counted.values():
                pipe.hdel(self._key(t), self.id)
            await pipe.execute()
            await self.gateways.leave(self.id)
