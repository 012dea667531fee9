"""The gateway: one OpenAI endpoint in front of many replicas. This module only builds the parts
and starts and stops them; a request's way through them is in pipeline.py.

    routes (routes.py) -> pipeline (pipeline.py) -> proxy (proxy/) -> admission (admission/)
        -> routing (routing/) -> the replica table (replicas/)
    the controller (control/) runs the replicas and reads admission's demand signals."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from fastapi import FastAPI

from shoal.fleet.admission.canary import CanarySplit
from shoal.fleet.admission.dispatch import Dispatcher
from shoal.fleet.admission.fair_queue import FairQueue
from shoal.fleet.admission.shared_concurrency import SharedConcurrency
from shoal.fleet.admission.shared_limits import SharedLimits
from shoal.fleet.admission.shared_usage import SharedUsage
from shoal.fleet.admission.shares import FairShares
from shoal.fleet.admission.signals import DemandSignals
from shoal.fleet.admission.store import StoreHealth, connect, shown
from shoal.fleet.admission.tenants import Tenants
from shoal.fleet.admission.usage import UsageLedger
from shoal.fleet.admission.usage_store import state_dir
from shoal.fleet.batch.redis_store import RedisBatchStore
from shoal.fleet.batch.runner import BatchService
from shoal.fleet.catalog import ModelCatalog
from shoal.fleet.config import FleetConfig, GatewayConfig
from shoal.fleet.control.controller import FleetController
from shoal.fleet.control.cores import CoreAllocator, planned_replicas
from shoal.fleet.control.launchers.base import Launcher
from shoal.fleet.control.launchers.local import LocalLauncher
from shoal.fleet.control.leader.leadership import Leadership
from shoal.fleet.control.rebalancer import Rebalancer
from shoal.fleet.grounding import Grounding
from shoal.fleet.listing import ModelListing
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.pipeline import Pipeline
from shoal.fleet.proxy.disagg import Disaggregator
from shoal.fleet.proxy.failure import FailureJudge, RetryBudget
from shoal.fleet.proxy.parts import RelayParts
from shoal.fleet.proxy.poison import PoisonGuard
from shoal.fleet.proxy.proxy import Proxy
from shoal.fleet.proxy.shadow import Shadow
from shoal.fleet.proxy.upstream import UpstreamClient
from shoal.fleet.replicas.health import HealthMonitor
from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.table import ReplicaTable
from shoal.fleet.routes import Edge, build_app
from shoal.fleet.routing.adapters import AdapterDirectory
from shoal.fleet.routing.policies import make_policy
from shoal.fleet.routing.prompt_keys import PromptKeys
from shoal.fleet.routing.tiers import TierRouter
from shoal.fleet.workload_trace import WorkloadTrace
from shoal.protocol.secrets import KV_TRANSFER_KEY_ENV

log = logging.getLogger(__name__)


class Gateway:
    def __init__(
        self, config: GatewayConfig, fleet: FleetConfig | None = None, launcher: Launcher | None = None
    ):
        """A gateway over `config.backends`, or over the replicas of `fleet` (whose gateway config
        `config` is), which it runs through `launcher` (default: local processes)."""
        self.config = config
        self.catalog = ModelCatalog.of(fleet) if fleet is not None else ModelCatalog()
        self.metrics = metrics = GatewayMetrics()
        # The replica table, and routing's view of it.
        self.index = index = PrefixIndex()
        self.policy = make_policy(config.policy, index, config.load_weight, config.imbalance_limit)
        self.table = table = ReplicaTable(index, metrics, config.block_size)
        parser = config.tool_call_parser or self.catalog.tool_call_parser() or "auto"
        self.keys = PromptKeys(config, table, parser)
        self.tiers = TierRouter(config.tiers, metrics)
        # Admission; with a store, what several gateways share (limits, usage) is kept there.
        self.store = connect(config.store, config.store_timeout_s) if config.store else None
        self.concurrency = store_health = None
        if self.store is not None:
            store_health = StoreHealth(shown(config.store))
            self.concurrency = SharedConcurrency(
                self.store, store_health, f"{config.store_prefix}concurrency:"
            )
        self.tenants = tenants = Tenants(
            config.tenants,
            config.api_key,
            on_limited=lambda t, limit: metrics.tenant_rate_limited.labels(t.name, limit).inc(),
            shared=(
                SharedLimits(self.store, store_health, f"{config.store_prefix}tenant:")
                if self.store is not None
                else None
            ),
            concurrency=self.concurrency,
        )
        self.demand = DemandSignals()
        self.canary = CanarySplit()
        self.client = UpstreamClient(config)
        self.adapters = AdapterDirectory(
            table, self.client.http, metrics, config.adapter_busy_at, lambda: self.dispatch.notify_nowait()
        )
        fair = FairQueue({t.name: t.config.weight for t in tenants.all.values()})
        self.dispatch = Dispatcher(
            config,
            table,
            self.policy,
            index,
            metrics,
            fair,
            FairShares(config, tenants, table),
            self.demand,
            self.canary,
            self.catalog.wakes,
            self.adapters,
        )
        poison = PoisonGuard(config.poison_ttl_s)
        # A replica that was unreachable and came back with the process it had was cut off, not
        # dead: its requests' strikes for that death are withdrawn.
        self.health = HealthMonitor(
            config, table, index, metrics, self.dispatch.notify_nowait, on_return=poison.absolve
        )
        shared_usage = SharedUsage(self.store, f"{config.store_prefix}usage:") if self.store else None
        self.usage = UsageLedger(tenants, shared_usage)
        # The proxy.
        judge = FailureJudge(table, self.health, poison, metrics)
        prefill = Disaggregator(config, table, index, self.dispatch, self.client, judge, metrics)
        parts = RelayParts(
            config,
            table,
            self.dispatch,
            self.client,
            judge,
            RetryBudget(config.retry_budget, metrics),
            prefill,
            self.keys,
            self.demand,
            metrics,
        )
        self.proxy = Proxy(parts)
        self.shadow = Shadow(table, self.client, metrics)
        # The edge.
        self.pipeline = Pipeline(
            config,
            self.catalog,
            tenants,
            self.keys,
            self.tiers,
            self.dispatch,
            self.proxy,
            metrics,
            self.adapters,
            Grounding(config.retrieval, self.client.http, metrics) if config.retrieval else None,
            WorkloadTrace(config.record_trace) if config.record_trace else None,
            self.shadow,
        )
        self.listing = ModelListing(table, self.catalog, self.tiers, self.client, self.adapters)
        self.batches = BatchService(
            config,
            self.dispatch,
            tenants.all,
            self.pipeline.run_internal,
            self.catalog.multi_model,
            RedisBatchStore(config.store, f"{config.store_prefix}batch:", config.batch_store_timeout_s)
            if self.store is not None
            else None,
        )
        # The replicas: the fleet's own, or those it was given.
        self.controller: FleetController | None = None
        if fleet is not None:
            self.controller = FleetController(
                fleet,
                launcher or self._local_launcher(fleet, config.replica_lifeline_s if self.store else 0.0),
                table,
                self.demand,
                self.canary,
                self.shadow,
                metrics,
                self.dispatch.notify_nowait,
            )
        # With a store, the gateways of one fleet elect which runs its controller and batches.
        self.leadership: Leadership | None = None
        if self.controller is not None and self.store is not None:
            self.leadership = Leadership(
                config, self.store, self.controller, table, self.batches, metrics, self.dispatch.notify_nowait
            )
        elif self.controller is not None:
            metrics.leading.set(1)  # the fleet's one gateway
        for i, url in enumerate(config.backends):
            table.add(f"backend-{i}", url)
        self.rebalancer = None
        if config.rebalance and not config.kv_transfer_key:
            log.warning("rebalancing is off: moving streams needs the K/V key $%s", KV_TRANSFER_KEY_ENV)
        elif config.rebalance:
            self.rebalancer = Rebalancer(config, table, metrics.registry)

    @staticmethod
    def _local_launcher(fleet: FleetConfig, lifeline_s: float) -> LocalLauncher:
        """Replicas on this host, sharing its cores among as many replicas as the fleet may run;
        with a lifeline, they outlive this gateway while another probes them."""
        replicas = planned_replicas(fleet.model_configs())
        return LocalLauncher(CoreAllocator.for_fleet(fleet.cores, replicas), lifeline_s)

    def build_app(self) -> FastAPI:
        return build_app(
            Edge(
                self.config,
                self.start,
                self.stop,
                self.pipeline,
                self.listing,
                self.catalog,
                self.table,
                self.index,
                self.policy,
                self.metrics,
                self.usage,
                self.batches,
                self.controller,
                self.adapters,
                self.leadership,
            )
        )

    async def start(self) -> None:
        where = state_dir(self.config.state_dir, self.config.port)
        if where is None:
            where = Path(tempfile.mkdtemp(prefix="shoal-gateway-"))
            log.warning("no cache directory: batch jobs and usage live in %s only", where)
        where.mkdir(parents=True, exist_ok=True)
        self.config.state_dir = str(where)
        await self.usage.start(where)
        if self.concurrency is not None:
            await self.concurrency.start()
        await self.batches.start(lead=self.leadership is None)
        if self.leadership is not None:
            await self.leadership.start()  # before the keys: the fleet's salt comes with it
        elif self.controller is not None:
            await self.controller.start()
        await self.health.start()
        await self.keys.start()
        if self.rebalancer is not None:
            await self.rebalancer.start()
        if self.pipeline.grounding is not None:
            await self.pipeline.grounding.start()

    async def stop(self) -> None:
        if self.pipeline.grounding is not None:
            await self.pipeline.grounding.stop()
        if self.rebalancer is not None:
            await self.rebalancer.stop()
        await self.batches.stop()
        await self.usage.stop()
        if self.leadership is not None:
            await self.leadership.stop()
        elif self.controller is not None:
            await self.controller.stop()
        await self.health.stop()
        if self.concurrency is not None:
            await self.concurrency.stop()
        await self.client.aclose()
        if self.store is not None:
            await self.store.aclose()
        if self.pipeline.trace is not None:
            self.pipeline.trace.close()
