"""Rebalancing by live migration (issue 29, after Llumnix): when one replica of a model has
requests queued in its engine or its KV cache nearly full while another of the same model has
room, some of the first one's running streams move to others (fleet/proxy/migration.py), instead
of the queue waiting on them or the engine preempting and recomputing.

Routing balances what arrives; this balances what has stayed: requests of very different
lengths, sessions pinned to a replica, a replica that came up after a burst. Moves go to the
replicas the routing policy picks among the others, the least urgent streams first (batch work
makes room for an interactive burst), then the longest (they hold the most blocks). A model's
replicas wait `rebalance_cooldown_s` after a move, so that their next /load answers show its
effect before another is decided."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from prometheus_client import Counter

from shoal.fleet.config import GatewayConfig
from shoal.fleet.replicas.replica import Health, Replica
from shoal.fleet.replicas.table import ReplicaTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Move:
    replica: str  # the hot replica streams leave
    streams: int
    reason: str  # "queued" (requests wait in its engine) or "kv_full"


def _hot(r: Replica, kv_high: float) -> str | None:
    load = r.load
    seats = load.get("max_num_seqs")
    full = not isinstance(seats, int) or load.get("running", 0) >= seats
    if load.get("waiting", 0) > 0 and full:
        # Queued behind a full batch. A request waiting while seats are free is one step from
        # running (a /load taken between its arrival and its first step): nothing to move for.
        return "queued"
    if load.get("kv_usage", 0.0) >= kv_high:
        return "kv_full"
    return None


def _room(r: Replica, kv_low: float, max_moves: int) -> int:
    """Streams `r` could take now: 0 unless nothing waits there and its KV cache has room."""
    load = r.load
    if load.get("waiting", 0) > 0 or load.get("kv_usage", 1.0) > kv_low:
        return 0
    seats = load.get("max_num_seqs")
    return max_moves if not isinstance(seats, int) else max(0, seats - load.get("running", 0))


def plan_moves(replicas: list[Replica], config: GatewayConfig) -> list[Move]:
    """The moves that would even out each model's replicas, from their last /load answers."""
    by_model: dict[str | None, list[Replica]] = {}
    for r in replicas:
        if r.state == Health.READY and r.routable(time.monotonic()) and "kv_usage" in r.load:
            by_model.setdefault(r.model, []).append(r)
    moves = []
    for group in by_model.values():
        room = sum(_room(r, config.rebalance_kv_low, config.rebalance_max_moves) for r in group)
        hot = [(r, why) for r in group if (why := _hot(r, config.rebalance_kv_high)) is not None]
        hot.sort(key=lambda h: (h[0].load.get("waiting", 0), h[0].load.get("kv_usage", 0.0)), reverse=True)
        coldest = min((r.load.get("running", 0) for r in group), default=0)
        for r, why in hot:
            # Half the gap in running streams to the least busy: both end near the middle.
            wanted = max(1, (r.load.get("running", 0) - coldest) // 2)
            n = min(wanted, room, config.rebalance_max_moves)
            if n > 0:
                moves.append(Move(r.name, n, why))
                room -= n
    return moves


class Rebalancer:
    def __init__(self, config: GatewayConfig, table: ReplicaTable, registry):
        self.config = config
        self.table = table
        self.quiet_until: dict[str | None, float] = {}  # model -> end of its cooldown
        self.moves = Counter(
            "shoal:gateway_rebalance_moves",
            "Streams the rebalancer asked to move off a replica, by why (queued, kv_full).",
            ["reason"],
            registry=registry,
        )
        self._task: asyncio.Task | None = None

    def tick(self, now: float) -> int:
        """Decides and starts this round's moves; returns how many streams began to move."""
        replicas = [r for r in self.table.replicas.values() if now >= self.quiet_until.get(r.model, 0.0)]
        started = 0
        for move in plan_moves(replicas, self.config):
            model = self.table.replicas[move.replica].model
            n = self.table.move_streams(move.replica, move.streams)
            if n:
                log.info("rebalancing: %d streams move off %s (%s)", n, move.replica, move.reason)
                self.moves.labels(move.reason).inc(n)
                self.quiet_until[model] = now + self.config.rebalance_cooldown_s
                started += n
        return started

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.rebalance_interval_s)
            try:
                self.tick(time.monotonic())
            except Exception:  # a bad round must not end the loop
                log.exception("rebalancing round failed")
