"""The controller's lease: one key in the store, set only if absent and with a time to live, and
extended only by its holder. The holder that stops renewing (killed, cut off from the store)
loses it when its time runs out; a holder that leaves gives it up at once."""

from __future__ import annotations

# Compare-and-extend, compare-and-delete: a holder whose lease ran out (and was taken) must not
# extend or delete its successor's.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Lease:
    def __init__(self, client, key: str, holder: str, ttl_s: float):
        self.client = client
        self.key = key
        self.holder = holder  # what this gateway writes: its id and the URL it answers at
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)

    async def acquire(self) -> bool:
        """Takes the lease if nobody holds it."""
        return bool(await self.client.set(self.key, self.holder, nx=True, px=self.ttl_ms))

    async def renew(self) -> bool:
        """Extends the lease; False: it is no longer ours."""
        return bool(await self._renew(keys=[self.key], args=[self.holder, self.ttl_ms]))

    async def release(self) -> None:
        await self._release(keys=[self.key], args=[self.holder])

    async def holder_now(self) -> str | None:
        """Who holds the lease now (None: nobody)."""
        value = await self.client.get(self.key)
        return value.decode() if value is not None else None
