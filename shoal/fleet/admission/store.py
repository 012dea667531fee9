"""The store several gateways share (`[gateway] store`, `--store URL`): a Redis client, from the
optional `redis` extra."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def connect(url: str):
    """An asyncio Redis client for `url` (it connects at its first command)."""
    try:
        import redis.asyncio as redis
    except ImportError:
        raise SystemExit("shoal: --store needs the Redis client: pip install 'shoal[redis]'") from None
    return redis.from_url(url)


def shown(url: str) -> str:
    """The store's URL without its password, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def store_errors() -> tuple[type[BaseException], ...]:
    """What a store that cannot be reached raises."""
    try:
        import redis
    except ImportError:  # no store client: no store errors, beside the network's
        return (OSError,)
    return (redis.RedisError, OSError)


# KEYS: the set. ARGV: the member, its time to live (ms), and "beat" or "leave". Scores are
# expiry times by the store's clock (gateways' clocks may differ). Returns how many members
# (this one included, unless it leaves) are alive.
PRESENCE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[3] == 'leave' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""


class Presence:
    """A set of gateways alive in the store: each renews its own entry, which expires unrenewed."""

    def __init__(self, client, key: str):
        self.key = key
        self._script = client.register_script(PRESENCE)

    async def beat(self, member: str, ttl_s: float) -> int:
        """`member` is alive for `ttl_s` more; returns how many are."""
        return int(await self._script(keys=[self.key], args=[member, int(ttl_s * 1000), "beat"]))

    async def leave(self, member: str) -> int:
        """`member` goes; returns how many others are alive."""
        return int(await self._script(keys=[self.key], args=[member, 0, "leave"]))
