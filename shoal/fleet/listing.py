"""`/v1/models`: what the ready replicas serve, every configured model (also one scaled to zero),
every LoRA adapter the fleet serves (also one no ready replica holds now: a request for it loads
it) and the tiers models, as far as the tenant may use them."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from shoal.fleet.admission.tenants import Tenant
from shoal.fleet.catalog import ModelCatalog
from shoal.fleet.proxy.upstream import UpstreamClient
from shoal.fleet.replicas.table import ReplicaTable
from shoal.fleet.routing.adapters import AdapterDirectory
from shoal.fleet.routing.tiers import TierRouter


def card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "shoal"}


class ModelListing:
    def __init__(
        self,
        table: ReplicaTable,
        catalog: ModelCatalog,
        tiers: TierRouter,
        client: UpstreamClient,
        adapters: AdapterDirectory,
    ):
        self.table = table
        self.catalog = catalog
        self.tiers = tiers
        self.client = client
        self.adapters = adapters

    async def list(self, tenant: Tenant, headers: dict[str, str]) -> dict[str, Any]:
        answers = await asyncio.gather(
            *(
                self.client.http.get(r.url + "/v1/models", headers=headers, timeout=5)
                for r in self.table.ready()
            ),
            return_exceptions=True,
        )
        cards: dict[str, Any] = {}
        if self.catalog.multi_model:  # also those scaled to zero
            for m in self.catalog.models:
                cards[m.name] = card(m.name)
        for a in answers:
            if not isinstance(a, BaseException) and a.status_code == 200:
                with contextlib.suppress(ValueError, AttributeError, KeyError, TypeError):
                    for c in a.json().get("data", []):
                        cards.setdefault(c["id"], c)
        for name in self.catalog.listed():  # a model at zero replicas is still there to ask for
            cards.setdefault(name, card(name))
        self.adapters.learn()
        bases = [c["id"] for c in cards.values() if c.get("parent") is None]
        for name, entry in self.adapters.entries.items():
            parent = entry.model or (bases[0] if bases else None)
            cards.setdefault(name, {**card(name), "root": entry.path, "parent": parent})
        for name in self.adapters.withdrawn:
            cards.pop(name, None)
        for t in self.tiers.routes:
            cards[t] = card(t)
        return {"object": "list", "data": [c for c in cards.values() if tenant.may_use(c["id"])]}
