"""What the relays work with: the parts below them, handed down once by the gateway. None of them
calls back into the proxy or a relay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shoal.fleet.admission.dispatch import Dispatcher
from shoal.fleet.admission.signals import DemandSignals
from shoal.fleet.config import GatewayConfig
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.proxy.failure import FailureJudge, RetryBudget
from shoal.fleet.proxy.forward import Forward
from shoal.fleet.proxy.upstream import UpstreamClient
from shoal.fleet.replicas.replica import Replica
from shoal.fleet.replicas.table import ReplicaTable
from shoal.fleet.routing.prompt_keys import PromptKeys


class PrefillStep(Protocol):
    """The P/D decider (disagg.py), or any part that may compute a prompt elsewhere first."""

    async def with_prefill(
        self, fwd: Forward, replica: Replica, body: dict, headers: dict, seen: dict
    ) -> tuple[dict, dict]: ...

    def headers(self, headers: dict) -> dict:
        """`headers` with what a replica needs to take K/V from another (the transfer key)."""
        ...


@dataclass(frozen=True)
class RelayParts:
    config: GatewayConfig
    table: ReplicaTable
    dispatch: Dispatcher
    client: UpstreamClient
    judge: FailureJudge
    retries: RetryBudget
    prefill: PrefillStep
    keys: PromptKeys  # a continuation's route keys
    demand: DemandSignals  # TTFTs, for the autoscaler
    metrics: GatewayMetrics
