"""Tenants' rate limits shared by every gateway over one Redis (`[gateway] store`, `--store URL`):
a tenant at 60 requests per minute gets 60 across all of them, not 60 at each.

Each limit is a token bucket kept in Redis (level and stamp in a hash), refilled and drawn in one
Lua script, so that two gateways admitting at once cannot both take the last request, with the
store's own clock (gateways' clocks may differ). A gateway still checks its own buckets first (its
level is never below the shared one, so they bind only where the shared ones would), and mirrors
the shared level for the x-ratelimit headers (concurrency limits: shared_concurrency.py). When
the store cannot be reached, requests are admitted on the gateway's own limits and a warning is
logged (the store is not a way to take the service down)."""

from __future__ import annotations

from shoal.fleet.admission.store import StoreHealth, store_errors

OWN_LIMITS = "admitting on this gateway's own tenant limits"  # while the store is away

# KEYS: the requests bucket, the tokens bucket. ARGV: per-second rate and capacity of each
# (a rate of 0: unlimited), the tokens to take, and the mode: "take" (both or nothing; returns
# each bucket's wait in seconds, "0" when taken) or "charge" (tokens only, may go below zero: a
# request that used more than it was charged; a negative amount is a refund).
SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local function level(key, rate, cap)
  local v = redis.call('HMGET', key, 'level', 'stamp')
  local lvl = tonumber(v[1]) or cap
  local stamp = tonumber(v[2]) or now
  return math.min(cap, lvl + math.max(0, now - stamp) * rate)
end
local function store(key, lvl, rate, cap)
  redis.call('HSET', key, 'level', tostring(lvl), 'stamp', tostring(now))
  redis.call('EXPIRE', key, math.ceil(2 * cap / rate) + 60)
end
local rr, rc = tonumber(ARGV[1]), tonumber(ARGV[2])
local tr, tc = tonumber(ARGV[3]), tonumber(ARGV[4])
local amount = tonumber(ARGV[5])
if ARGV[6] == 'charge' then
  if tr > 0 then store(KEYS[2], math.min(tc, level(KEYS[2], tr, tc) - amount), tr, tc) end
  return {'0', '0', '-1', '-1'}
end
local rl, tl = -1, -1
local wr, wt = 0, 0
if rr > 0 then
  rl = level(KEYS[1], rr, rc)
  if rl < 1 then wr = (1 - rl) / rr end
end
if tr > 0 then
  tl = level(KEYS[2], tr, tc)
  local need = math.min(amount, tc)
  if tl < need then wt = (need - tl) / tr end
end
if wr > 0 or wt > 0 then
  return {tostring(wr), tostring(wt), tostring(rl), tostring(tl)}
end
if rr > 0 then rl = rl - 1; store(KEYS[1], rl, rr, rc) end
if tr > 0 then tl = tl - amount; store(KEYS[2], tl, tr, tc) end
return {'0', '0', tostring(rl), tostring(tl)}
"""


class SharedLimits:
    def __init__(self, client, health: StoreHealth, prefix: str):
        """`client`: the store's (store.py); `health`: whether to ask it now."""
        self.health = health
        self.client = client
        self.script = client.register_script(SCRIPT)
        self.prefix = prefix
        self.errors = store_errors()

    def _args(self, tenant, tokens: float, mode: str) -> tuple[list[str], list]:
        keys = [f"{self.prefix}{tenant.name}:requests", f"{self.prefix}{tenant.name}:tokens"]
        r, t = tenant.requests, tenant.tokens
        args = [r.rate if r.limited else 0, r.capacity, t.rate if t.limited else 0, t.capacity, tokens, mode]
        return keys, args

    async def take(self, tenant, tokens: float) -> tuple[float, float, float, float]:
        """Takes a request and `tokens` from the tenant's shared buckets, or neither: the seconds
        to wait for each (0 when taken, and when the store did not answer), then each bucket's
        level (-1: not limited, or not known)."""
        if not self.health.usable():
            return 0.0, 0.0, -1.0, -1.0
        keys, args = self._args(tenant, tokens, "take")
        try:
            out = await self.script(keys=keys, args=args)
        except self.errors as exc:
            self.health.failed(exc, OWN_LIMITS)
            return 0.0, 0.0, -1.0, -1.0
        self.health.answered()
        wait_r, wait_t, level_r, level_t = (float(x) for x in out)
        return wait_r, wait_t, level_r, level_t

    async def charge(self, tenant, tokens: float) -> None:
        """Tokens a request used beyond what it was charged (negative: a refund)."""
        if not tenant.tokens.limited or not tokens or not self.health.usable():
            return  # (while the store is away, the charge is lost)
        keys, args = self._args(tenant, tokens, "charge")
        try:
            await self.script(keys=keys, args=args)
        except self.errors as exc:
            self.health.failed(exc, OWN_LIMITS)
