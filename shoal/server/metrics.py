"""Prometheus metrics of one replica, named as the field names them (`shoal:` prefix)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shoal.protocol import tracing
from shoal.protocol.metric_names import LATENCY_BUCKETS

if TYPE_CHECKING:
    from shoal.engine.outputs import RequestOutput
    from shoal.engine.step_result import EngineStats


class _EngineCollector:
    """Gauges and counters read from the engine's own counts at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        if s is None:
            return
        label = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        yield gauge("shoal:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("shoal:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("shoal:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", s.kv_usage)
        yield gauge("shoal:kv_cache_free_blocks", "KV cache blocks free or evictable.", s.num_free_blocks)
        yield counter(
            "shoal:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries
        )
        yield counter("shoal:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits)
        yield counter("shoal:num_preemptions", "Requests preempted to free KV blocks.", s.num_preemptions)
        yield counter("shoal:engine_steps", "Engine steps run.", s.num_steps)
        yield counter(
            "shoal:engine_step_forward_seconds",
            "Seconds of engine steps spent in the model's forward, logits and sampling.",
            s.forward_seconds,
        )
        yield counter(
            "shoal:engine_step_host_seconds",
            "Seconds of engine steps spent on everything else: scheduling, batch preparation, "
            "bookkeeping of the step's results.",
            s.host_seconds,
        )
        yield counter(
            "shoal:engine_steps_decided_ahead",
            "Greedy decode steps whose forward was queued by the step before, behind it on the device.",
            s.steps_from_queue,
        )
        yield counter(
            "shoal:engine_steps_decided_ahead_dropped",
            "Steps queued ahead and dropped: the scheduler asked for another (a request ended or joined).",
            s.queued_steps_dropped,
        )
        if s.spec is not None:
            yield counter(
                "shoal:spec_decode_num_drafts", "Verify passes of proposed tokens.", s.spec.num_drafts
            )
            yield counter(
                "shoal:spec_decode_num_draft_tokens",
                "Tokens proposed for verification.",
                s.spec.num_draft_tokens,
            )
            yield counter(
                "shoal:spec_decode_num_accepted_tokens",
                "Proposed tokens the model accepted.",
                s.spec.num_accepted_tokens,
            )
            per_pos = CounterMetricFamily(
                "shoal:spec_decode_num_accepted_tokens_per_pos",
                "Proposed tokens accepted, by their position in the proposal (0 = first).",
                labels=["model_name", "position"],
            )
            for j, n in enumerate(s.spec.accepted_per_position):
                per_pos.add_metric([self.model_name, str(j)], n)
            yield per_pos
        if s.ranks:
            yield from self._rank_metrics(s.ranks)
        if s.lora is not None:
            yield from self._lora_metrics(s.lora)
        if s.kv_offload_saved is not None:
            for name, doc, counts in (
                (
                    "shoal:kv_offload_saved_blocks",
                    "KV blocks evicted from the pool into each tier.",
                    s.kv_offload_saved,
                ),
                (
                    "shoal:kv_offload_loaded_blocks",
                    "KV blocks loaded back from each tier instead of computed.",
                    s.kv_offload_loaded,
                ),
            ):
                family = CounterMetricFamily(name, doc, labels=["model_name", "tier"])
                for tier in ("host", "disk"):
                    family.add_metric([self.model_name, tier], counts.get(tier, 0))
                yield family
        if s.moe_balance is not None:
            if s.moe_balance.imbalance is not None:
                yield gauge(
                    "shoal:moe_rank_load_imbalance",
                    "Max over mean of the tokens the ranks' experts took in the last balancing window.",
                    s.moe_balance.imbalance,
                )
            yield counter(
                "shoal:moe_rebalances", "New placements of replicated experts.", s.moe_balance.rebalances
            )
        if s.moe_expert_tokens is not None:
            family = CounterMetricFamily(
                "shoal:moe_expert_tokens",
                "Tokens the router sent to each expert of each mixture-of-experts layer.",
                labels=["model_name", "layer", "expert"],
            )
            for layer, counts in s.moe_expert_tokens.items():
                for expert, n in enumerate(counts):
                    family.add_metric([self.model_name, str(layer), str(expert)], n)
            yield family

    def _lora_metrics(self, lora):
        resident = GaugeMetricFamily(
            "shoal:lora_adapter_resident",
            "1 for each LoRA adapter in the model's slots.",
            labels=["model_name", "adapter"],
        )
        for name in lora.resident:
            resident.add_metric([self.model_name, name], 1)
        yield resident
        for name, doc, counts in (
            ("shoal:lora_adapter_loads", "Times a LoRA adapter was put in a slot.", lora.loads),
            (
                "shoal:lora_adapter_evictions",
                "Times a resident LoRA adapter was displaced by another.",
                lora.evictions,
            ),
            ("shoal:lora_requests", "Requests admitted, by LoRA adapter.", lora.requests),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name", "adapter"])
            for adapter, n in sorted(counts.items()):
                family.add_metric([self.model_name, adapter], n)
            yield family

    def _rank_metrics(self, ranks):
        """Each tensor/pipeline-parallel rank's profile: where its step time goes."""
        families = [
            ("shoal:parallel_rank_steps", "Steps a rank has run.", "steps"),
            ("shoal:parallel_rank_step_seconds", "Time a rank spent in steps.", "step_s"),
            ("shoal:parallel_rank_comm_seconds", "Time a rank spent in collectives.", "comm_s"),
            ("shoal:parallel_rank_collectives", "Collectives a rank has joined.", "comm_calls"),
            (
                "shoal:parallel_rank_moe_dispatch_seconds",
                "Of a rank's collectives, a mixture of experts' sending tokens to their experts' ranks.",
                "moe_dispatch_s",
            ),
            (
                "shoal:parallel_rank_moe_combine_seconds",
                "Of a rank's collectives, a mixture of experts' putting its experts' outputs together.",
                "moe_combine_s",
            ),
            (
                "shoal:parallel_rank_stage_wait_seconds",
                "Time a rank waited for the previous pipeline stage's hidden states.",
                "stage_wait_s",
            ),
        ]
        for name, doc, attr in families:
            c = CounterMetricFamily(name, doc, labels=["model_name", "rank"])
            for r in ranks:
                c.add_metric([self.model_name, str(r.rank)], getattr(r, attr))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def hist(name, doc):
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.ttft = hist("shoal:time_to_first_token_seconds", "Time from arrival to the first output token.")
        self.itl = hist("shoal:inter_token_latency_seconds", "Time between successive output tokens.")
        self.e2e = hist("shoal:e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = hist("shoal:request_queue_time_seconds", "Time from arrival to first scheduling.")
        self.prompt_tokens = Counter(
            "shoal:prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            "shoal:generation_tokens", "Output tokens generated.", labels, registry=self.registry
        )
        self.request_success = Counter(
            "shoal:request_success",
            "Finished requests by reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        adapter_labels = [*labels, "adapter"]
        self.lora_prompt_tokens = Counter(
            "shoal:lora_prompt_tokens", "Prompt tokens processed, by LoRA adapter.", adapter_labels,
            registry=self.registry,
        )  # fmt: skip
        self.lora_generation_tokens = Counter(
            "shoal:lora_generation_tokens", "Output tokens generated, by LoRA adapter.", adapter_labels,
            registry=self.registry,
        )  # fmt: skip
        self.request_errors = Counter(
            "shoal:request_errors",
            "Requests refused or failed, by HTTP status.",
            [*labels, "status"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(model_name, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def timer(self, start: float, adapter: str | None = None) -> RequestTimer:
        return RequestTimer(self, start, adapter)


class RequestTimer:
    """Observes one engine request's latencies from the step times stamped on its outputs."""

    def __init__(self, metrics: ServerMetrics, start: float, adapter: str | None = None):
        self.m = metrics
        self.start = start
        self.adapter = adapter  # the LoRA adapter the request runs with, if any
        self.last: float | None = None
        self.done = False
        # The request's span, when it is traced: its engine phases are recorded under it.
        span = trace.get_current_span()
        self.span = span if span.is_recording() else None
        self.scheduled: float | None = None
        self.first: float | None = None
        self.tokens = 0

    def observe(self, out: RequestOutput) -> None:
        m, name = self.m, self.m.model_name
        now = out.metrics.get("time", self.start)
        tokens = sum(len(o.delta_token_ids) for o in out.outputs)
        if tokens:
            if self.last is None:
                m.ttft.labels(name).observe(now - self.start)
                self.first = now
                scheduled = self.scheduled = out.metrics.get("first_scheduled_time")
                if scheduled is not None:
                    m.queue_time.labels(name).observe(max(0.0, scheduled - out.metrics["arrival_time"]))
            else:
                m.itl.labels(name).observe(now - self.last)
            self.last = now
            self.tokens += tokens
            m.generation_tokens.labels(name).inc(tokens)
            if self.adapter is not None:
                m.lora_generation_tokens.labels(name, self.adapter).inc(tokens)
        if out.finished:
            self.done = True
            m.e2e.labels(name).observe(now - self.start)
            m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
            if self.adapter is not None:
                m.lora_prompt_tokens.labels(name, self.adapter).inc(len(out.prompt_token_ids))
            for o in out.outputs:
                m.request_success.labels(name, o.finish_reason or "abort").inc()
            if self.span is not None:
                self._trace(out, now)

    def _trace(self, out: RequestOutput, end: float) -> None:
        """The engine's phases as spans: queued, prefill (to the first token), decode."""
        arrival = out.metrics.get("arrival_time", self.start)
        scheduled = self.scheduled if self.scheduled is not None else self.first
        attrs = {"shoal.request_id": out.request_id, "shoal.prompt_tokens": len(out.prompt_token_ids)}
        if scheduled is not None:
            tracing.record("engine.queue", self.span, arrival, scheduled, **attrs)
        if self.first is not None:
            cached = {"shoal.cached_tokens": out.num_cached_tokens}
            tracing.record("engine.prefill", self.span, scheduled, self.first, **attrs, **cached)
            tokens = {"shoal.output_tokens": self.tokens}
            tracing.record("engine.decode", self.span, self.first, end, **attrs, **tokens)

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.m.request_success.labels(self.m.model_name, "abort").inc()
