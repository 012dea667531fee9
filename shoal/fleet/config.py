"""Gateway and fleet configuration, from flags or a TOML file."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

POLICIES = ("kv_aware", "round_robin", "least_load", "power_of_two", "session")


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    backends: list[str] = field(default_factory=list)  # replicas that already run
    policy: str = "kv_aware"
    tokenizer: str | None = None  # checkpoint whose tokenizer hashes prompts (kv_aware); default bundled
    api_key: str | None = None
    session_header: str = "x-session-id"
    # Backpressure: requests in flight per replica, then a bounded queue, then 503.
    max_inflight_per_replica: int = 64
    max_queue: int = 256
    queue_timeout_s: float = 30.0
    # Failover.
    max_retries: int = 2  # further replicas tried for one request
    retry_budget: float = 0.2  # retries may add at most this fraction of recent requests
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 120.0
    # Health.
    probe_interval_s: float = 1.0
    load_poll_interval_s: float = 0.25
    kv_poll_interval_s: float = 0.1
    eject_after_errors: int = 3  # consecutive failures before the circuit opens
    eject_for_s: float = 5.0  # open circuit, then half-open: one trial request
    # kv_aware: cost = uncached prompt blocks + load_weight * outstanding requests; when the busiest
    # candidate has more than imbalance_limit outstanding requests beyond the idlest, least load decides.
    # A weight of a few blocks lets one shared system prompt herd every new conversation onto the
    # replica that saw it first; 8 spreads them while a conversation's own history still holds it.
    load_weight: float = 8.0
    imbalance_limit: int = 16
    block_size: int = 16  # until a replica reports its own


@dataclass
class FleetConfig:
    replicas: int = 2
    model: str | None = None
    base_port: int = 8100  # replicas listen on base_port, base_port + 1, ...
    replica_args: list[str] = field(default_factory=list)  # extra `shoal serve` flags
    restart_backoff_s: float = 1.0
    gateway: GatewayConfig = field(default_factory=GatewayConfig)


def _fill(cls, data: dict[str, Any]):
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys: {', '.join(sorted(unknown))}")
    return cls(**data)


def load_fleet_config(path: str | Path) -> FleetConfig:
    """A TOML file: top-level fleet keys (replicas, model, base_port, replica_args) and a [gateway] table."""
    data = tomllib.loads(Path(path).read_text())
    gateway = _fill(GatewayConfig, data.pop("gateway", {}))
    cfg = _fill(FleetConfig, data)
    cfg.gateway = gateway
    if gateway.policy not in POLICIES:
        raise ValueError(f"unknown policy {gateway.policy!r}; choose from {', '.join(POLICIES)}")
    return cfg
