"""What the gateways of one fleet keep in their shared store beside the lease: the fleet's
secrets (the same K/V salt and transfer key at every gateway), the gateways alive (each renews
its own entry), and the replica set as its leader last published it, which the others route by
and a new leader adopts."""

from __future__ import annotations

import json

from shoal.fleet.admission.store import Presence

# KEYS: the lease, the state. ARGV: the holder, the state. Only the lease's holder writes: a
# leader cut off from the store past its lease must not overwrite its successor's state.
PUBLISH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2])
  return 1
end
return 0
"""


class FleetRegistry:
    def __init__(self, client, prefix: str):
        self.client = client
        self.prefix = prefix  # e.g. "shoal:fleet:"
        self.lease_key = prefix + "leader"
        self.gateways = Presence(client, prefix + "gateways")
        self._publish = client.register_script(PUBLISH)

    async def secrets(self, salt: str, transfer_key: str) -> tuple[str, str]:
        """The fleet's K/V salt and transfer key: the first gateway's, which every other takes."""
        key = self.prefix + "secrets"
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(key, "kv_salt", salt)
        pipe.hsetnx(key, "kv_transfer_key", transfer_key)
        pipe.hmget(key, "kv_salt", "kv_transfer_key")
        *_, (got_salt, got_key) = await pipe.execute()
        return got_salt.decode(), got_key.decode()

    async def publish(self, holder: str, state: dict) -> bool:
        """The leader's replica set, pools and status; False: `holder` no longer leads."""
        out = await self._publish(
            keys=[self.lease_key, self.prefix + "state"], args=[holder, json.dumps(state)]
        )
        return bool(out)

    async def state(self) -> dict | None:
        raw = await self.client.get(self.prefix + "state")
        return json.loads(raw) if raw else None

    async def clear(self) -> None:
        """The last gateway stopped its replicas: nothing is left to adopt."""
        await self.client.delete(self.prefix + "state", self.prefix + "secrets")
