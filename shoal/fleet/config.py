"""Gateway and fleet configuration, from flags or a TOML file."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shoal.fleet.admission.tenants import TenantConfig
from shoal.fleet.control.autoscaler import AutoscaleConfig
from shoal.fleet.control.canary_judge import CanaryConfig
from shoal.fleet.control.cores import CoresConfig
from shoal.fleet.routing.policies import POLICIES
from shoal.fleet.routing.tiers import TierConfig
from shoal.protocol.bodies import DEFAULT_MAX_BODY_BYTES
from shoal.protocol.bounds import check_bounds
from shoal.protocol.secrets import KV_TRANSFER_KEY_ENV
from shoal.retrieval.router import RetrievalIndexConfig


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    backends: list[str] = field(default_factory=list)  # replicas that already run
    # A Redis URL (redis://host:port/db): what several gateways of one service share (tenants'
    # limits and usage, batch jobs and their files; for a fleet, the replica set and who leads its
    # controller: fleet/control/leader/). None: this gateway's alone.
    store: str | None = None
    store_prefix: str = "shoal:"  # of its keys: one store may serve several fleets
    # A store command unanswered this long failed: admission goes on without the store meanwhile.
    store_timeout_s: float = 1.0
    # The leader's lease lasts this long unrenewed: a follower leads this soon after it dies.
    lease_ttl_s: float = 3.0
    # With a store, replicas outlive the gateway that started them; they exit once no gateway has
    # probed them for this long (the last gateway of the fleet is gone).
    replica_lifeline_s: float = 20.0
    policy: str = "kv_aware"
    tokenizer: str | None = None  # checkpoint whose tokenizer hashes prompts (kv_aware); default bundled
    # How the replicas offer tools in a prompt (their --tool-call-parser), for the same hashes;
    # default: as a fleet starts its replicas, else auto.
    tool_call_parser: str | None = None
    api_key: str | None = None  # clients must send it; /health, /ready and /metrics stay open
    replica_api_key: str | None = None  # what the gateway sends to replicas; default: api_key
    kv_salt: str | None = None  # salt of the prompt block hashes; default: $SHOAL_KV_SALT, else from the key
    session_header: str = "x-session-id"
    # Hostile input: bodies past this size get 413 unread; prompts past this many characters are
    # routed on a hash of their text instead of tokenized (they cannot fit any context anyway).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    route_tokenize_max_chars: int = 64 * 1024
    # Clients may lower their priority (a larger number), never raise it above the default 0.
    trust_client_priority: bool = False
    # Backpressure: requests in flight per replica, then a bounded queue, then 503.
    max_inflight_per_replica: int = 64
    max_queue: int = 256
    queue_timeout_s: float = 30.0
    # A request for a model with no active replica waits this long for one to start or be promoted.
    cold_start_timeout_s: float = 180.0
    # Failover.
    max_retries: int = 2  # further replicas tried for one request
    retry_budget: float = 0.2  # retries may add at most this fraction of recent requests
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 120.0  # a stream's first event (queueing and prefill included)
    stream_idle_timeout_s: float = 30.0  # between events of a stream
    request_timeout_s: float = 1800.0  # the whole of a non-streamed request
    # A non-streamed completion goes upstream as a stream, folded back into one answer, so that it
    # goes on from where it was when its replica dies and can be moved live, like a stream. False:
    # sent as it came (for backends whose streamed answers say less than their whole ones).
    fold_unary: bool = True
    # A JSON line per request served, for `shoal sim --trace` (None: none kept).
    record_trace: str | None = None
    # SIGTERM: the gateway stops taking connections and gives the requests in flight this long
    # before it stops its replicas and exits.
    shutdown_timeout_s: float = 30.0
    # OpenTelemetry spans of the gateway and the replicas it starts go here over OTLP/HTTP
    # (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; none: spans are not exported).
    otlp_traces_endpoint: str | None = None
    # A request present when its replica died is struck; one that kills (or is in) a second, or
    # alone crashes an engine, is poison: failed once and refused for this long.
    poison_ttl_s: float = 600.0
    # Health: a probe that times out is a miss, `probe_misses` in a row mark the replica down; a
    # refused connection marks it down at once. Relays from a replica marked down fail over at once.
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 1.0
    probe_misses: int = 2
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
    # LoRA adapters: an adapter's requests go to the replicas holding it; a holder with this many
    # outstanding requests is busy, and when every holder is, the adapter is loaded on one more
    # replica. A fleet-wide unload waits this long for the requests using the adapter to end.
    adapter_busy_at: int = 16
    adapter_unload_drain_s: float = 30.0
    block_size: int = 16  # until a replica reports its own
    # Prefill/decode disaggregation, where some replicas have the prefill role: a prompt with fewer
    # tokens than this left to compute on the chosen decode worker (short, or mostly cached there)
    # is prefilled on that worker, since moving its K/V would cost more than it saves. 0 sends
    # every prompt to a prefill worker. The default is from benchmarks/disaggregation.py (see README).
    disagg_min_prompt_tokens: int = 256
    prefill_timeout_s: float = 30.0  # a remote prefill past this is abandoned and run on decode
    # Blocks from peers: a request sent to a replica that lacks at least this many tokens of its
    # prompt's prefix which another replica holds fetches them from that one instead of computing
    # them (over the K/V transport, with the transfer key). 0: never.
    peer_fetch_min_tokens: int = 128
    # Rebalancing by live migration (control/rebalancer.py): every interval, a replica with
    # requests queued in its engine, or KV usage at kv_high or more, moves some running streams to
    # replicas of its model with nothing queued and KV usage at kv_low or less (at most max_moves a
    # round; then its model's replicas wait cooldown_s). Needs the K/V transfer key.
    rebalance: bool = False
    rebalance_interval_s: float = 0.5
    rebalance_kv_high: float = 0.9
    rebalance_kv_low: float = 0.6
    rebalance_max_moves: int = 4
    rebalance_cooldown_s: float = 2.0
    # Authenticates the gateway's kv_transfer_params and the workers' K/V pulls to each other;
    # default $SHOAL_KV_TRANSFER_KEY, and a local fleet makes one for itself.
    kv_transfer_key: str | None = field(default_factory=lambda: os.environ.get(KV_TRANSFER_KEY_ENV) or None)
    # Tenants ([[tenants]] tables): keys, limits, priority classes and fair-share weights. Without
    # any, `api_key` (if set) is the only key and every request is one anonymous tenant's.
    tenants: list[TenantConfig] = field(default_factory=list)
    # Requests waiting for a replica go by priority, then by each tenant's weighted share of tokens
    # served (fair_queue.py); false: by priority, then first come first served.
    fair_queuing: bool = True
    # Retrieval indexes ([[retrieval]] tables): sharded vector indexes that /v1/retrieve searches
    # and chats are grounded in (see fleet/grounding.py).
    retrieval: list[RetrievalIndexConfig] = field(default_factory=list)
    # Tiers routes ([[tiers]] tables): a model id that answers from a cheap model or a strong one.
    tiers: list[TierConfig] = field(default_factory=list)
    # Where the gateway keeps what must survive it (batch jobs, usage totals); default:
    # $SHOAL_STATE_DIR, else the shoal cache directory, per port.
    state_dir: str | None = None
    # The batch lane: its requests run at this priority (after every interactive class) and at
    # most this many at once, only on spare capacity (see batch/runner.py).
    batch_priority: int = 100
    batch_max_inflight: int = 4
    batch_poll_interval_s: float = 0.2
    batch_max_file_bytes: int = 200 << 20  # an uploaded batch input file (OpenAI's limit)
    # A command to the shared store's batch state unanswered this long failed (the batch API
    # answers 503, the lane tries again): long enough for a whole input file to go in one.
    batch_store_timeout_s: float = 30.0

    def check(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        whole = ("max_body_bytes", "route_tokenize_max_chars", "max_inflight_per_replica", "probe_misses")
        whole += ("eject_after_errors", "adapter_busy_at", "block_size", "rebalance_max_moves")
        whole += ("batch_max_inflight", "batch_max_file_bytes")
        waits = ("lease_ttl_s", "queue_timeout_s", "cold_start_timeout_s", "connect_timeout_s")
        waits += ("first_byte_timeout_s", "stream_idle_timeout_s", "request_timeout_s", "probe_interval_s")
        waits += ("probe_timeout_s", "load_poll_interval_s", "kv_poll_interval_s", "prefill_timeout_s")
        waits += ("rebalance_interval_s", "batch_poll_interval_s", "store_timeout_s", "batch_store_timeout_s")
        none_below_0 = ("port", "replica_lifeline_s", "max_queue", "max_retries", "retry_budget")
        none_below_0 += ("shutdown_timeout_s", "poison_ttl_s", "eject_for_s", "load_weight")
        none_below_0 += ("imbalance_limit", "adapter_unload_drain_s", "disagg_min_prompt_tokens")
        none_below_0 += ("peer_fetch_min_tokens", "rebalance_cooldown_s", "rebalance_kv_low")
        check_bounds(
            self,
            {**dict.fromkeys(whole, 1), **dict.fromkeys(none_below_0, 0)},
            above={**dict.fromkeys(waits, 0), "rebalance_kv_high": self.rebalance_kv_low},
            most={"port": 65535, "rebalance_kv_high": 1},
        )

    @property
    def replica_key(self) -> str | None:
        return self.replica_api_key if self.replica_api_key is not None else self.api_key


@dataclass
class ModelConfig:
    """One model the fleet serves and how its replicas scale. Active replicas take traffic and stay
    within [min_replicas, max_replicas]; `warm_standby` more are loaded but take none until promoted;
    with min_replicas 0, a model idle for `scale_to_zero_after_s` has no active replica."""

    name: str | None = None  # the model id clients send; None: a one-model fleet answers any id
    model: str | None = None  # checkpoint (default: the bundled model)
    replica_args: list[str] = field(default_factory=list)  # extra `shoal serve` flags
    min_replicas: int = 1
    max_replicas: int = 1
    warm_standby: int = 0
    scale_to_zero_after_s: float | None = None
    memory_mb: float = 0.0  # what one replica takes, for placement within memory_budget_mb
    # Disaggregated: this many prefill and decode workers (a fixed pool of each) instead.
    prefill: int = 0
    decode: int = 0
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)

    @property
    def key(self) -> str:
        return self.name or "default"

    def check(self) -> None:
        if self.prefill < 0 or self.decode < 0 or (self.prefill > 0) != (self.decode > 0):
            raise ValueError("a disaggregated fleet needs at least one prefill and one decode worker")
        if not 0 <= self.min_replicas <= self.max_replicas or self.warm_standby < 0:
            raise ValueError(
                f"model {self.key}: need 0 <= min_replicas ({self.min_replicas}) <= max_replicas "
                f"({self.max_replicas}) and warm_standby >= 0"
            )
        if self.max_replicas == 0 and not self.prefill:
            raise ValueError(f"model {self.key}: max_replicas must be at least 1")
        check_bounds(self, {"memory_mb": 0, "scale_to_zero_after_s": 0})
        self.autoscale.check()

    @property
    def autoscaled(self) -> bool:
        """Whether its replicas (of role both) scale: a fixed pool's bounds leave nothing to decide."""
        fixed = self.min_replicas == self.max_replicas and not self.warm_standby
        return not self.prefill and not (fixed and self.scale_to_zero_after_s is None)

    def pools(self) -> list[tuple[str, int, int]]:
        """(role, min, max) of each pool of replicas this model runs."""
        if self.prefill:
            return [("prefill", self.prefill, self.prefill), ("decode", self.decode, self.decode)]
        return [("both", self.min_replicas, self.max_replicas)]


@dataclass
class FleetConfig:
    # One model: `replicas` of it, fixed (or autoscaled within min/max_replicas when they are set).
    replicas: int = 2
    # A disaggregated fleet: this many prefill and decode workers instead of `replicas` of both roles.
    prefill: int = 0
    decode: int = 0
    model: str | None = None
    replica_args: list[str] = field(default_factory=list)  # extra `shoal serve` flags
    min_replicas: int | None = None
    max_replicas: int | None = None
    warm_standby: int = 0
    scale_to_zero_after_s: float | None = None
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    # Several models ([[models]] tables): each with its own replicas and scaling; the keys above
    # then do not apply.
    models: list[ModelConfig] = field(default_factory=list)
    base_port: int = 8100  # replicas listen on base_port, base_port + 1, ...
    restart_backoff_s: float = 1.0  # doubles with each quick death, up to the cap
    restart_backoff_max_s: float = 30.0
    restart_reset_after_s: float = 60.0  # a replica up this long starts from the first backoff again
    drain_timeout_s: float = 300.0  # a draining replica still busy after this is stopped anyway
    update_ready_timeout_s: float = 300.0  # a rolling update's new replica not ready by then: rolled back
    canary: CanaryConfig = field(default_factory=CanaryConfig)  # ... or failing far more requests
    # Memory this node gives its replicas (each model's memory_mb each); None: no limit. When a
    # replica does not fit, the least recently used idle model that may scale to zero is unloaded.
    memory_budget_mb: float | None = None
    cores: CoresConfig = field(default_factory=CoresConfig)  # this host's cores among its replicas
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def model_configs(self) -> list[ModelConfig]:
        if self.models:
            return self.models
        fixed = self.min_replicas is None and self.max_replicas is None
        lo = self.replicas if fixed else (self.min_replicas or 0)
        hi = self.replicas if fixed else (self.max_replicas if self.max_replicas is not None else max(lo, 1))
        one = ModelConfig(
            name=None,
            model=self.model,
            replica_args=self.replica_args,
            min_replicas=lo,
            max_replicas=hi,
            warm_standby=self.warm_standby,
            scale_to_zero_after_s=self.scale_to_zero_after_s,
            prefill=self.prefill,
            decode=self.decode,
            autoscale=self.autoscale,
        )
        return [one]

    def check(self) -> None:
        names = [m.name for m in self.models]
        if self.models and (None in names or len(set(names)) != len(names)):
            raise ValueError("each [[models]] table needs its own name (the model id clients send)")
        for m in self.model_configs():
            m.check()
        waits = ("restart_backoff_s", "restart_backoff_max_s", "restart_reset_after_s", "drain_timeout_s")
        check_bounds(
            self,
            {"base_port": 0, "memory_budget_mb": 0, **dict.fromkeys(waits, 0)},
            above={"update_ready_timeout_s": 0},
            most={"base_port": 65535},
        )
        self.cores.check()
        self.canary.check()
        self.gateway.check()


def _fill(cls, data: dict[str, Any]):
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys: {', '.join(sorted(unknown))}")
    return cls(**data)


def _model(data: dict[str, Any]) -> ModelConfig:
    m = _fill(ModelConfig, {k: v for k, v in data.items() if k != "autoscale"})
    m.autoscale = _fill(AutoscaleConfig, data.get("autoscale", {}))
    return m


def load_fleet_config(path: str | Path) -> FleetConfig:
    """A TOML file: top-level fleet keys (replicas, model, base_port, replica_args, min_replicas, ...),
    an [autoscale] table, [cores], [rollout], [[models]] tables (each with its own [models.autoscale]),
    [gateway], [[tenants]] and [[tiers]]."""
    data = tomllib.loads(Path(path).read_text())
    gateway = _fill(GatewayConfig, data.pop("gateway", {}))
    gateway.tenants = [_fill(TenantConfig, t) for t in data.pop("tenants", [])]
    gateway.tiers = [_fill(TierConfig, t) for t in data.pop("tiers", [])]
    gateway.retrieval = [_fill(RetrievalIndexConfig, t) for t in data.pop("retrieval", [])]
    models = [_model(m) for m in data.pop("models", [])]
    autoscale = _fill(AutoscaleConfig, data.pop("autoscale", {}))
    cores = _fill(CoresConfig, data.pop("cores", {}))
    if "rollout" in data and "canary" in data:
        raise ValueError(
            "give the rolling update's bounds in [rollout] ([canary] is its older name), not both"
        )
    canary = _fill(CanaryConfig, data.pop("rollout", None) or data.pop("canary", {}))
    cfg = _fill(FleetConfig, data)
    cfg.gateway, cfg.models, cfg.autoscale, cfg.cores, cfg.canary = gateway, models, autoscale, cores, canary
    cfg.check()
    for t in gateway.tenants:
        t.check()
        t.key_hash()  # a key that cannot be read fails now, not at the first request
        if t.priority >= gateway.batch_priority:
            raise ValueError(f"tenant {t.name}: priority {t.priority} must be below batch_priority")
    return cfg
