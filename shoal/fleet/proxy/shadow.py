"""Shadow traffic: during a rolling update, a share of a model's requests (`[rollout] shadow`) is
also sent to a replica of the new version, loaded but not yet taking traffic, or taking its
canary share. Its answer is compared with the one the client got and thrown away. What the copy
costs the new version (its time to first token, its gaps between tokens, a failure) counts
in the rollout's judgement (control/canary_judge.py) like any request it served, so a version
can be judged before a client depends on it. Answers are compared only where they are
reproducible: greedy requests, or seeded ones (a seed makes a replica's draws its own).

A copy is held back while the new replica has as many requests in flight as the busiest replica
of the old version: with a share near 1, one new replica would otherwise carry the whole pool's
traffic, and its latency, judged against replicas carrying their part of it, would roll back a
version for its load rather than its speed."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.proxy.forward import Forward
from shoal.fleet.proxy.upstream import Attempt, UpstreamClient, sse_events
from shoal.fleet.replicas.replica import Health, Lifecycle, Replica
from shoal.fleet.replicas.table import ReplicaTable

log = logging.getLogger(__name__)

SHADOWED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
TIMEOUT_S = 300.0


def reproducible(body: dict) -> bool:
    """Whether two runs of `body` must give the same tokens: greedy, or seeded."""
    return body.get("temperature") == 0 or isinstance(body.get("seed"), int)


class Shadow:
    def __init__(self, table: ReplicaTable, client: UpstreamClient, metrics: GatewayMetrics):
        self.table = table
        self.client = client
        self.metrics = metrics
        self.targets: dict[str | None, tuple[str, int, float]] = {}  # model -> (pool, version, share)
        self.tasks: set[asyncio.Task] = set()

    def start(self, model: str | None, pool: str, version: int, share: float) -> None:
        self.targets[model] = (pool, version, share)

    def stop(self, model: str | None) -> None:
        self.targets.pop(model, None)

    def copy(self, fwd: Forward) -> None:
        """Sends a copy of `fwd` to the new version, by its share; the copy's answer is compared
        with `fwd`'s once both have ended."""
        target = self.targets.get(fwd.route.model)
        if target is None or fwd.path not in SHADOWED_PATHS or random.random() >= target[2]:
            return
        pool, version, _ = target
        replica = self._replica(fwd.route.model, version)
        if replica is None:
            return
        if replica.inflight >= self._old_load(fwd.route.model, version):
            return self.metrics.shadow.labels(pool, "held").inc()
        fwd.primary_output = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._run(pool, replica, fwd))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _replica(self, model: str | None, version: int) -> Replica | None:
        live = [
            r
            for r in self.table.replicas.values()
            if r.model == model
            and r.version == version
            and r.state == Health.READY
            and r.lifecycle in (Lifecycle.STANDBY, Lifecycle.READY)
        ]
        return min(live, key=lambda r: r.inflight, default=None)

    def _old_load(self, model: str | None, version: int) -> int:
        """Requests in flight on the busiest serving replica of the other versions (at least 1)."""
        old = [
            r.inflight
            for r in self.table.replicas.values()
            if r.model == model
            and r.version != version
            and r.state == Health.READY
            and r.lifecycle == Lifecycle.READY
        ]
        return max([1, *old])

    async def _run(self, pool: str, replica: Replica, fwd: Forward) -> None:
        body = {k: v for k, v in fwd.body.items() if k != "stream_options"}
        body.update(stream=True, return_token_ids=True)
        outputs: dict[int, list[int]] = {}
        attempt = Attempt(replica)
        replica.inflight += 1
        replica.requests_total += 1
        failed = True
        try:
            async with attempt.deadline(TIMEOUT_S):
                resp = await self.client.send(replica, fwd.path, json.dumps(body).encode(), fwd.headers)
                try:
                    if resp.status_code == 200:
                        async for obj in sse_events(resp, attempt, TIMEOUT_S, TIMEOUT_S):
                            tokens = 0
                            for ch in obj.get("choices") or []:
                                ids = ch.get("token_ids") or []
                                outputs.setdefault(ch.get("index", 0), []).extend(ids)
                                tokens += len(ids)
                            if tokens:
                                attempt.took_tokens(tokens, time.monotonic())
                        failed = False
                    else:
                        failed = resp.status_code >= 500
                        text = (await resp.aread())[:200]
                        log.warning("shadow copy to %s: HTTP %d %s", replica.name, resp.status_code, text)
                finally:
                    await resp.aclose()
        except Exception as exc:  # the copy's failure is the judge's to count, not the client's
            log.warning("shadow copy to %s failed: %r", replica.name, exc)
        finally:
            attempt.done()
            replica.inflight -= 1
            replica.failed_total += int(failed)
        if failed:
            return self.metrics.shadow.labels(pool, "failed").inc()
        try:
            primary = await asyncio.wait_for(fwd.primary_output, TIMEOUT_S)
        except TimeoutError:  # the client's request outlived its copy by minutes
            primary = None
        if primary is None or not reproducible(fwd.body):
            return self.metrics.shadow.labels(pool, "not_compared").inc()
        ours = [outputs.get(i, []) for i in range(len(primary))]
        same = ours == primary
        self.metrics.shadow.labels(pool, "same" if same else "different").inc()
        if not same:
            log.warning("shadow copy on %s answered otherwise than the client's answer", replica.name)
