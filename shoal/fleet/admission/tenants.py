"""Tenants: who a request is from, what it may use, how fast, and at which priority.

Keys are known only by their SHA-256, so neither the config nor a log holds one. Limits are
token buckets refilled continuously (a minute's allowance at most): requests per minute, tokens
per minute (charged the prompt and the requested completion at admission, then corrected to what
was used), and requests in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.fleet.admission.shared_concurrency import SharedConcurrency
from shoal.fleet.admission.shared_limits import SharedLimits
from shoal.protocol.errors import APIError

ANONYMOUS = "anonymous"  # the tenant of a gateway without tenants
OPERATOR = "operator"  # the gateway's own api_key, when tenants are configured beside it
# Completion tokens charged up front when a request names no max_tokens; corrected when it ends.
DEFAULT_COMPLETION_ESTIMATE = 256


@dataclass
class TenantConfig:
    """One `[[tenants]]` table. Its key is given as a SHA-256 (hex), or read from an environment
    variable or a file; limits of 0 are no limit. Lower priority values run first (0 is the
    default class); `weight` is the tenant's share when the fleet is saturated."""

    name: str
    api_key_sha256: str | None = None
    api_key_env: str | None = None
    api_key_file: str | None = None
    requests_per_minute: float = 0
    tokens_per_minute: float = 0
    max_concurrency: int = 0
    priority: int = 0
    models: list[str] = field(default_factory=list)  # empty: every model
    weight: float = 1.0
    # A limit's bucket holds this many seconds of its rate (at least one request): bursts up to
    # that pass, a minute's worth at once does not (OpenAI enforces its limits the same way).
    burst_s: float = 10.0

    def key_hash(self) -> str:
        given = [k for k in (self.api_key_sha256, self.api_key_env, self.api_key_file) if k]
        if len(given) != 1:
            raise ValueError(
                f"tenant {self.name}: give exactly one of api_key_sha256, api_key_env, api_key_file"
            )
        if self.api_key_sha256:
            digest = self.api_key_sha256.strip().lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"tenant {self.name}: api_key_sha256 is not a SHA-256 hex digest")
            return digest
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(f"tenant {self.name}: the environment variable {self.api_key_env} is unset")
        else:
            key = Path(self.api_key_file).expanduser().read_text().strip()
            if not key:
                raise ValueError(f"tenant {self.name}: {self.api_key_file} is empty")
        return key_digest(key)

    def check(self) -> None:
        if not self.name or self.weight <= 0:
            raise ValueError(f"tenant {self.name!r}: needs a name and a weight above 0")
        if min(self.requests_per_minute, self.tokens_per_minute, self.max_concurrency) < 0:
            raise ValueError(f"tenant {self.name}: limits cannot be negative")
        if not 0 < self.burst_s <= 60:
            raise ValueError(f"tenant {self.name}: burst_s must be in (0, 60]")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _reset(seconds: float) -> str:
    """OpenAI's reset format: 250ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


class TokenBucket:
    """`per_minute` refilled continuously, holding `burst_s` seconds of it (at least 1); 0 is
    unlimited. It may go below zero when a request used more than it was charged: later requests
    then wait for the debt."""

    def __init__(self, per_minute: float, burst_s: float = 60.0, clock=time.monotonic):
        self.per_minute = float(per_minute)
        self.rate = self.per_minute / 60.0  # per second
        self.capacity = max(1.0, self.rate * burst_s) if per_minute > 0 else 0.0
        self.level = self.capacity
        self.clock = clock
        self.stamp = clock()

    @property
    def limited(self) -> bool:
        return self.per_minute > 0

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0: now)."""
        if not self.limited:
            return 0.0
        self._refill()
        need = min(amount, self.capacity) - self.level
        return max(0.0, need / self.rate)

    def take(self, amount: float) -> None:
        if self.limited:
            self._refill()
            self.level -= amount

    def give(self, amount: float) -> None:
        """Returns what a take took (the request was refused after all)."""
        if self.limited:
            self._refill()
            self.level = min(self.capacity, self.level + amount)

    def mirror(self, level: float) -> None:
        """The level of the bucket this one stands for across gateways (shared_limits.py)."""
        self.level, self.stamp = level, self.clock()

    def remaining(self) -> int:
        if not self.limited:
            return 0
        self._refill()
        return max(0, int(self.level))

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        if not self.limited:
            return 0.0
        self._refill()
        return (self.capacity - self.level) / self.rate


@dataclass
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rate_limited: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "rate_limited": self.rate_limited,
        }


class Tenant:
    def __init__(self, config: TenantConfig, clock=time.monotonic):
        self.config = config
        self.name = config.name
        self.requests = TokenBucket(config.requests_per_minute, config.burst_s, clock)
        self.tokens = TokenBucket(config.tokens_per_minute, config.burst_s, clock)
        self.inflight = 0
        self.clock = clock
        self.last_admitted = float("-inf")
        self.usage: dict[str, Usage] = {}  # by lane: interactive, batch

    def active(self, window_s: float) -> bool:
        """Has requests in flight, or had one admitted within `window_s`: it wants a share."""
        return self.inflight > 0 or self.clock() - self.last_admitted < window_s

    def may_use(self, model: str | None) -> bool:
        return not self.config.models or model in self.config.models

    def priority_for(self, asked) -> int:
        """The tenant's class, or a lower one (a larger value) when the client asks for it."""
        own = self.config.priority
        if isinstance(asked, int) and not isinstance(asked, bool):
            return max(asked, own)
        return own

    def rate_headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket.limited:
                out[f"x-ratelimit-limit-{kind}"] = f"{bucket.per_minute:g}"
                out[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining())
                out[f"x-ratelimit-reset-{kind}"] = _reset(bucket.reset_s())
        return out

    def lane_usage(self, lane: str) -> Usage:
        return self.usage.setdefault(lane, Usage())


class Ticket:
    """One admitted request: its tokens recorded as its parts end, then settled once."""

    def __init__(self, tenant: Tenant, charged: int, lane: str, counted: bool = True):
        self.tenant = tenant
        self.charged = charged
        self.lane = lane
        self.counted = counted  # in the tenant's requests in flight (interactive ones are)
        self.prompt_tokens = self.completion_tokens = 0
        self.open = True
        self.on_charge: Callable[[int], None] | None = None  # the debt or refund, for a shared store
        self.on_release: Callable[[], None] | None = None  # its place in a shared concurrency limit

    def record(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def settle(self) -> None:
        if not self.open:
            return
        self.open = False
        t = self.tenant
        if self.counted:
            t.inflight -= 1
            # A refund when it used less than it was charged, a debt when more.
            delta = self.prompt_tokens + self.completion_tokens - self.charged
            t.tokens.take(delta)
            if self.on_charge is not None:
                self.on_charge(delta)
            if self.on_release is not None:
                self.on_release()
        u = t.lane_usage(self.lane)
        u.prompt_tokens += self.prompt_tokens
        u.completion_tokens += self.completion_tokens


class Tenants:
    """Keys to tenants, and admission against each tenant's limits."""

    def __init__(
        self,
        configs: list[TenantConfig],
        operator_key: str | None,
        clock=time.monotonic,
        on_limited: Callable[[Tenant, str], None] | None = None,
        shared: SharedLimits | None = None,
        concurrency: SharedConcurrency | None = None,
    ):
        """`shared`, `concurrency`: the rate and concurrency limits every gateway over one store
        draws from (None: this gateway's alone)."""
        self.on_limited = on_limited or (lambda tenant, limit: None)  # (tenant, limit): for metrics
        self.shared = shared
        self.concurrency = concurrency
        self._charges: set[asyncio.Task] = set()
        self.by_hash: dict[str, Tenant] = {}
        self.all: dict[str, Tenant] = {}
        for c in configs:
            c.check()
            if c.name in self.all:
                raise ValueError(f"two tenants are named {c.name}")
            tenant = self.all[c.name] = Tenant(c, clock)
            digest = c.key_hash()
            if digest in self.by_hash:
                raise ValueError(f"tenants {self.by_hash[digest].name} and {c.name} have the same key")
            self.by_hash[digest] = tenant
        self.open = not configs and not operator_key  # no key needed at all
        self.anonymous = Tenant(TenantConfig(ANONYMOUS))
        if operator_key:
            op = self.all.setdefault(OPERATOR, Tenant(TenantConfig(OPERATOR)))
            self.by_hash.setdefault(key_digest(operator_key), op)
        if self.open:
            self.all[ANONYMOUS] = self.anonymous

    def authenticate(self, authorization: str) -> Tenant:
        if self.open:
            return self.anonymous
        scheme, _, key = authorization.partition(" ")
        tenant = self.by_hash.get(key_digest(key.strip())) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")
        return tenant

    @staticmethod
    def check_model(tenant: Tenant, model) -> None:
        """404 for a model the tenant may not use (as for one that does not exist)."""
        if not tenant.may_use(model):
            raise APIError(
                404,
                f"the model {str(model)[:100]!r} does not exist or you do not have access to it",
                "model",
                "model_not_found",
            )

    def admit(self, tenant: Tenant, model: str | None, tokens: int, lane: str = "interactive") -> Ticket:
        """A ticket for one request of about `tokens` tokens, or the APIError that refuses it."""
        self.check_model(tenant, model)
        cfg = tenant.config
        if cfg.max_concurrency and tenant.inflight >= cfg.max_concurrency:
            raise self._limited(
                tenant,
                "concurrency",
                1.0,
                f"tenant {tenant.name} has {tenant.inflight} requests in flight, its limit",
            )
        wait_r = tenant.requests.wait_for(1)
        if wait_r > 0:
            raise self._limited(
                tenant,
                "requests",
                wait_r,
                f"rate limit of {cfg.requests_per_minute:g} requests per minute reached",
            )
        wait_t = tenant.tokens.wait_for(tokens)
        if wait_t > 0:
            raise self._limited(
                tenant, "tokens", wait_t, f"rate limit of {cfg.tokens_per_minute:g} tokens per minute reached"
            )
        tenant.requests.take(1)
        tenant.tokens.take(tokens)
        tenant.inflight += 1
        tenant.last_admitted = tenant.clock()
        tenant.lane_usage(lane).requests += 1
        return Ticket(tenant, tokens, lane)

    async def admit_across(self, tenant: Tenant, model: str | None, tokens: int) -> Ticket:
        """`admit`, and with a shared store, against the limits all its gateways draw from."""
        ticket = self.admit(tenant, model, tokens)
        cfg, places = tenant.config, self.concurrency
        if places is not None and cfg.max_concurrency:
            held = await places.enter(tenant)
            if held >= 0:
                self._undo(ticket, tokens)
                message = f"tenant {tenant.name} has {held} requests in flight across its gateways, its limit"
                raise self._limited(tenant, "concurrency", 1.0, message)
            ticket.on_release = lambda: places.leave(tenant)
        shared = self.shared
        if shared is None or not (tenant.requests.limited or tenant.tokens.limited):
            return ticket
        wait_r, wait_t, level_r, level_t = await shared.take(tenant, tokens)
        refused = wait_r or wait_t
        if refused:  # what this gateway took goes back
            self._undo(ticket, tokens)
        for bucket, level in ((tenant.requests, level_r), (tenant.tokens, level_t)):
            if level >= 0:  # the headers say what is left across the gateways
                bucket.mirror(level)
        if refused:
            cfg = tenant.config
            if wait_r:
                message = f"rate limit of {cfg.requests_per_minute:g} requests per minute reached"
                raise self._limited(tenant, "requests", wait_r, message)
            message = f"rate limit of {cfg.tokens_per_minute:g} tokens per minute reached"
            raise self._limited(tenant, "tokens", wait_t, message)

        def charge(delta: int) -> None:
            task = asyncio.get_running_loop().create_task(shared.charge(tenant, delta))
            self._charges.add(task)
            task.add_done_callback(self._charges.discard)

        ticket.on_charge = charge
        return ticket

    @staticmethod
    def _undo(ticket: Ticket, tokens: int) -> None:
        """A ticket refused by the limits across the gateways: what this gateway took goes back."""
        t = ticket.tenant
        ticket.open = False
        t.inflight -= 1
        t.lane_usage(ticket.lane).requests -= 1
        t.requests.give(1)
        t.tokens.give(tokens)
        if ticket.on_release is not None:
            ticket.on_release()

    def batch_ticket(self, tenant: Tenant) -> Ticket:
        """A batch request's ticket: counted in usage, outside the interactive limits."""
        tenant.lane_usage("batch").requests += 1
        return Ticket(tenant, 0, "batch", counted=False)

    def _limited(self, tenant: Tenant, limit: str, wait_s: float, message: str) -> APIError:
        tenant.lane_usage("interactive").rate_limited += 1
        self.on_limited(tenant, limit)
        headers = {**tenant.rate_headers(), "Retry-After": str(max(1, math.ceil(wait_s)))}
        return APIError(
            429, f"{message}; retry after {wait_s:.1f} s", code="rate_limit_exceeded", headers=headers
        )

    def counts(self) -> dict[tuple[str, str], Usage]:
        """This process's usage by (tenant, lane)."""
        return {(t.name, lane): u for t in self.all.values() for lane, u in t.usage.items()}
