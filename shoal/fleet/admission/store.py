"""The store several gateways share (`[gateway] store`, `--store URL`): a Redis client, from the
optional `redis` extra."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)


def connect(url: str, timeout_s: float, blocking: bool = False):
    """A Redis client for `url`, asyncio's (or a `blocking` one), that connects at its first
    command; its commands give up after `timeout_s`, once: a store behind a cut link answers
    nothing, and the client's defaults (5 s, or none, and retries) would hold a caller that long."""
    try:
        if blocking:
            import redis
            from redis.retry import Retry
        else:
            import redis.asyncio as redis
            from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
    except ImportError:
        raise SystemExit("shoal: --store needs the Redis client: pip install 'shoal[redis]'") from None
    return redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


class StoreHealth:
    """Whether admission asks the store now: not from a failure to answer until the concurrency
    beat (every second) finds it answering again, so that while it is away each request is
    admitted on the gateway's own counts at once, not after a timeout of its own. Says so in the
    log once when it goes, once when it is back."""

    def __init__(self, url: str):
        """`url`: the store as the log names it (shown)."""
        self.url = url
        self._away = False

    def usable(self) -> bool:
        return not self._away

    def failed(self, exc: BaseException, what: str) -> None:
        """It did not answer; `what` the gateway does meanwhile, for the log."""
        if not self._away:
            self._away = True
            log.warning("store %s: %s; %s", self.url, str(exc) or type(exc).__name__, what)

    def answered(self) -> None:
        if self._away:
            self._away = False
            log.warning("store %s answers again", self.url)


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
