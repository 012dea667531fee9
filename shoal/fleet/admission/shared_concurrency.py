"""Tenants' concurrency limits shared by every gateway over one store: a tenant allowed 4
requests in flight gets 4 across all of them.

Each gateway keeps its own count per tenant in one hash field (its id, new each process), and
says it is alive in a sorted set of expiry times, renewed every second. A request is admitted by
one script that sums the fields of the gateways alive and adds one to its own if the sum is
below the limit: the counts of a gateway that died (its entry expired) stop counting at once and
are removed, so a dead gateway's requests do not hold the tenant's limit. When the store cannot
be reached, the gateway admits on its own counts until its renewal finds the store again
(store.StoreHealth).

Each renewal also writes the places this gateway holds over what the store has of them, so a
count the store lost (a release that failed, a store restarted empty) heals within a second.
That write overwrites, so it holds this gateway's new admissions and releases back, waits for
those on their way to be answered, and lets them go once it has landed: else it would count a
place twice (written, then added by its admission) or bring back one just released."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from shoal.fleet.admission.store import Presence, StoreHealth, store_errors

ALIVE_S = 5.0  # a gateway unheard of this long is dead
OWN_COUNTS = "admitting on this gateway's own concurrency counts"
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
    def __init__(self, client, health: StoreHealth, prefix: str):
        """`prefix`: of the keys, e.g. "shoal:concurrency:"; `health`: whether to ask the store now
        (its beat says whether the store answers again)."""
        self.client = client
        self.health = health
        self.prefix = prefix
        self.id = uuid.uuid4().hex
        self.errors = store_errors()
        self._enter = client.register_script(ENTER)
        self.gateways = Presence(client, prefix + "gateways")
        self._task: asyncio.Task | None = None
        self._releases: set[asyncio.Task] = set()
        # Tenant name -> its places this gateway holds, as its admissions and releases sent say:
        # every tenant it has admitted, whose count it writes in each heal.
        self._held: dict[str, int] = {}
        self._on_the_way = 0  # admissions and releases sent and not yet answered
        self._answered = asyncio.Event()  # set while none is on its way
        self._answered.set()
        self._healing: asyncio.Event | None = None  # set when a heal's write has landed

    def _key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    async def enter(self, tenant) -> int:
        """Takes one of the tenant's places: -1 when taken (or the store did not answer), else the
        count held across the gateways (the limit is reached)."""
        self._held.setdefault(tenant.name, 0)
        keys = [self._key(tenant.name), self.gateways.key]
        await self._heal_landed()
        held = -1  # while the store is away: on this gateway's counts (mended by a heal once back)
        if self.health.usable():
            self._send()
            try:
                held = int(await self._enter(keys=keys, args=[self.id, tenant.config.max_concurrency]))
            except self.errors as exc:
                self.health.failed(exc, OWN_COUNTS)
            finally:
                self._answer()
        if held < 0:
            self._held[tenant.name] += 1
        return held

    def leave(self, tenant) -> None:
        """Gives the place back (in the background: the answer is already on its way)."""

        async def release() -> None:
            await self._heal_landed()
            self._held[tenant.name] -= 1
            if not self.health.usable():
                return
            self._send()
            try:
                await self.client.hincrby(self._key(tenant.name), self.id, -1)
            except self.errors as exc:
                self.health.failed(exc, OWN_COUNTS)
            finally:
                self._answer()

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _send(self) -> None:
        self._on_the_way += 1
        self._answered.clear()

    def _answer(self) -> None:
        self._on_the_way -= 1
        if not self._on_the_way:
            self._answered.set()

    async def _heal_landed(self) -> None:
        while self._healing is not None:
            await self._healing.wait()

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
                self.health.answered()
                await self._heal()
            except self.errors as exc:
                self.health.failed(exc, OWN_COUNTS)

    async def _heal(self) -> None:
        """The places this gateway holds over what the store has of them."""
        if not self._held or self._healing is not None:
            return
        self._healing = asyncio.Event()
        try:
            try:  # bounded: one answer that never comes must not hold admissions back for good
                async with asyncio.timeout(BEAT_S):
                    await self._answered.wait()
            except TimeoutError:
                return
            pipe = self.client.pipeline(transaction=False)
            for name, held in self._held.items():
                pipe.hset(self._key(name), self.id, held)
            await pipe.execute()
        finally:
            self._healing.set()
            self._healing = None

    async def stop(self) -> None:
        """This gateway's counts go, and it from the gateways alive."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(*self.errors):
            pipe = self.client.pipeline(transaction=False)
            for name in self._held:
                pipe.hdel(self._key(name), self.id)
            await pipe.execute()
            await self.gateways.leave(self.id)
