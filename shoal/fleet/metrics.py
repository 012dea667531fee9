"""The gateway's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shoal.protocol.metric_names import LATENCY_BUCKETS


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "shoal:gateway_requests", "Requests sent to each replica.", ["replica"], registry=r
        )
        self.responses = Counter(
            "shoal:gateway_responses", "Responses to clients by status.", ["status"], registry=r
        )
        self.decisions = Counter(
            "shoal:gateway_routing_decisions",
            "Routing decisions by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "shoal:gateway_retries", "Requests retried on another replica.", ["reason"], registry=r
        )
        self.failovers = Counter(
            "shoal:gateway_failovers",
            "Streams continued on another replica after a failure mid-stream.",
            registry=r,
        )
        self.poison = Counter(
            "shoal:gateway_poison_requests",
            "Requests that took a replica down and were failed instead of sent to another.",
            registry=r,
        )
        self.ejections = Counter(
            "shoal:gateway_ejections", "Circuit breaker openings.", ["replica"], registry=r
        )
        self.rejections = Counter(
            "shoal:gateway_rejections", "Requests refused with 503 (queue full).", registry=r
        )
        self.inflight = Gauge(
            "shoal:gateway_inflight_requests", "Requests in flight.", ["replica"], registry=r
        )
        self.queued = Gauge(
            "shoal:gateway_queued_requests",
            "Requests waiting at the gateway for a replica of their model (all at their cap).",
            ["model"],
            registry=r,
        )
        self.replica_up = Gauge(
            "shoal:gateway_replica_ready", "1 when the replica takes traffic.", ["replica"], registry=r
        )
        self.role_waiting = Gauge(
            "shoal:gateway_role_queue_depth",
            "Requests waiting in the engines of the ready replicas of each role (prefill, decode, both).",
            ["role"],
            registry=r,
        )
        self.leading = Gauge(
            "shoal:gateway_leader",
            "1 while this gateway leads its fleet's controller (several gateways over one store).",
            registry=r,
        )
        self.gateways_alive = Gauge(
            "shoal:gateway_fleet_gateways",
            "Gateways of this fleet alive, as the shared store says.",
            registry=r,
        )
        self.desired = Gauge(
            "shoal:gateway_desired_replicas",
            "Active replicas each pool's autoscaler wants.",
            ["pool"],
            registry=r,
        )
        self.lifecycle = Gauge(
            "shoal:gateway_pool_replicas",
            "Replicas of each pool by lifecycle state (starting, standby, ready, draining, stopped).",
            ["pool", "state"],
            registry=r,
        )
        self.autoscaler_decisions = Counter(
            "shoal:gateway_autoscaler_decisions",
            "Scaling decisions by pool, direction and the signal that decided.",
            ["pool", "direction", "signal"],
            registry=r,
        )
        self.replica_start = Histogram(
            "shoal:gateway_replica_start_seconds",
            "Until a replica takes traffic: cold, from starting its process; warm, a standby promoted, "
            "from the autoscaler asking for it.",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rollouts = Counter(
            "shoal:gateway_rolling_updates",
            "Rolling updates by pool and outcome (done, rolled_back).",
            ["pool", "outcome"],
            registry=r,
        )
        self.rollout_error_rate = Gauge(
            "shoal:gateway_rollout_error_rate",
            "During a rolling update: the share of requests each version (new, old) failed since it began.",
            ["pool", "version"],
            registry=r,
        )
        self.rollout_ttft_p99 = Gauge(
            "shoal:gateway_rollout_ttft_p99_seconds",
            "During a rolling update: each version's p99 time to first token since it began.",
            ["pool", "version"],
            registry=r,
        )
        self.rollout_itl_p99 = Gauge(
            "shoal:gateway_rollout_itl_p99_seconds",
            "During a rolling update: each version's p99 time between tokens since it began.",
            ["pool", "version"],
            registry=r,
        )
        self.shadow = Counter(
            "shoal:gateway_shadow_requests",
            "Shadow copies sent to a rolling update's new version, by how their answers compared with "
            "the client's (same, different, not_compared: not reproducible), failed, or held (not sent: the "
            "new replica was as loaded as the busiest old one).",
            ["pool", "outcome"],
            registry=r,
        )
        self.unloads = Counter(
            "shoal:gateway_model_unloads",
            "Idle models unloaded to make memory for another's replica.",
            ["pool"],
            registry=r,
        )
        self.cold_start_wait = Histogram(
            "shoal:gateway_cold_start_wait_seconds",
            "Time a request waited at the gateway for a model with no active replica.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "shoal:gateway_time_to_first_token_seconds",
            "Gateway-side time to the first streamed byte.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "shoal:gateway_inter_token_latency_seconds",
            "Gateway-side time between a stream's tokens (per token, where an event carries several).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "shoal:gateway_e2e_request_latency_seconds",
            "Gateway-side request latency.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.tenant_requests = Counter(
            "shoal:gateway_tenant_requests",
            "Requests admitted per tenant and lane (interactive, batch).",
            ["tenant", "lane"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "shoal:gateway_tenant_tokens",
            "Tokens served per tenant, lane and kind (prompt, completion).",
            ["tenant", "lane", "kind"],
            registry=r,
        )
        self.tenant_rate_limited = Counter(
            "shoal:gateway_tenant_rate_limited",
            "Requests refused with 429 per tenant and limit (requests, tokens, concurrency).",
            ["tenant", "limit"],
            registry=r,
        )
        self.tenant_queue = Histogram(
            "shoal:gateway_tenant_queue_seconds",
            "Time a tenant's requests waited at the gateway for a replica.",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tier_requests = Counter(
            "shoal:gateway_tier_requests",
            "Requests to a tiers route by the tier that answered (cheap, strong).",
            ["route", "tier"],
            registry=r,
        )
        self.tier_escalations = Counter(
            "shoal:gateway_tier_escalations",
            "Requests a tiers route sent to its strong model, by rule (length, hint, confidence).",
            ["route", "reason"],
            registry=r,
        )

        self.migrations = Counter(
            "shoal:gateway_migrations",
            "Streams asked to move off a replica: moved (ok), started again elsewhere before their "
            "first token (restarted), nothing left to move, or left where they ran (no_target: no "
            "replica to take them; target_failed: it failed the copy; ended meanwhile).",
            ["outcome"],
            registry=r,
        )
        self.migration_pause = Histogram(
            "shoal:gateway_migration_pause_seconds",
            "Time a moved stream's client saw no token: from its last token before the switch to "
            "its first after it.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.migration_copy = Histogram(
            "shoal:gateway_migration_copy_seconds",
            "Time a moving stream's context took to copy to its target while it went on decoding.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.adapter_loads = Counter(
            "shoal:gateway_adapter_loads",
            "LoRA adapters the gateway loaded on a replica, by why (load_route, none_held, busy).",
            ["adapter", "reason"],
            registry=r,
        )
        self.replica_adapters = Gauge(
            "shoal:gateway_replica_adapters",
            "LoRA adapters each replica holds (registered) and has in its slots (resident).",
            ["replica", "state"],
            registry=r,
        )

        self.retrieval_queries = Counter(
            "shoal:gateway_retrieval_queries",
            "Retrieval queries by index, whole or partial (a shard missed the latency budget).",
            ["index", "answer"],
            registry=r,
        )
        self.retrieval_shard_seconds = Histogram(
            "shoal:gateway_retrieval_shard_seconds",
            "Time each shard's answer took, from the replica that gave it.",
            ["index", "shard"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.retrieval_hedges = Counter(
            "shoal:gateway_retrieval_hedges",
            "Queries sent to a second replica of a shard because the first was slow.",
            ["index"],
            registry=r,
        )
        self.retrieval_replica_up = Gauge(
            "shoal:gateway_retrieval_replica_up",
            "1 while a shard replica answers its health probe.",
            ["index", "shard", "replica"],
            registry=r,
        )
        self.retrieval_failovers = Counter(
            "shoal:gateway_retrieval_failovers",
            "Queries sent to another replica of a shard because one failed.",
            ["index"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
