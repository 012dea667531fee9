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
