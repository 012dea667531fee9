"""Offload tiers below the KV pool: host memory, then local disk.

A pool block evicted while it still holds a cached prefix is kept below instead of lost: in a
bounded host-memory tier, whose least recently used blocks move on to a bounded disk tier, whose
least recently used are dropped. A prompt whose prefix goes on, past what the pool holds, in a
tier gets fresh blocks that the step fills from the tier instead of computing them.

This index (which hashes each tier holds) lives with the scheduler; the bytes live with the
runner (kv_tier_store.py), which carries out the moves the index orders, in order, at the start
of the step they came with: a block is saved before that step's forward writes over it, and
loaded before the forward reads it."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierMove:
    """One move of one block's K/V. kind: "save" (pool block -> host slot), "save_disk" (pool
    block -> disk, with no host tier), "demote" (host slot -> disk), "drop" (off the disk),
    "load_host" (host slot -> pool block), "load_disk" (disk -> pool block)."""

    kind: str
    block_hash: int
    block_id: int = -1
    host_slot: int = -1


@dataclass(frozen=True)
class TierSpec:
    """How many blocks each tier holds (both sides count alike), and where the disk tier goes."""

    host_blocks: int
    disk_blocks: int
    disk_root: str | None

    @classmethod
    def of(cls, host_bytes: int, disk_path: str | None, disk_bytes: int, block_bytes: int) -> TierSpec | None:
        """The tiers the budgets hold (a block's bytes being the largest rank's), or None for none."""
        spec = cls(host_bytes // block_bytes, disk_bytes // block_bytes if disk_path else 0, disk_path)
        return spec if spec.host_blocks or spec.disk_blocks else None


class KVTierIndex:
    def __init__(self, host_blocks: int, disk_blocks: int):
        self.host_blocks = host_blocks
        self.disk_blocks = disk_blocks
        self.host: OrderedDict[int, int] = OrderedDict()  # hash -> host slot, least recent first
        self.free_slots = list(range(host_blocks - 1, -1, -1))
        self.disk: OrderedDict[int, None] = OrderedDict()  # hashes on disk, least recent first
        self.moves: list[TierMove] = []  # for the next step, in order
        self.saved: Counter[str] = Counter()  # blocks put in each tier
        self.loaded: Counter[str] = Counter()  # blocks taken back from each tier
        # The tiers loaded from: those that bring a block back faster than computing it does.
        self.usable = {"host", "disk"}
        self.costs: dict[str, float] = {}  # seconds a block, as measured at start
        # Told each hash that leaves the last tier holding it (the replica no longer has it).
        self.on_drop: Callable[[int], None] | None = None

    def calibrate(self, costs: dict[str, float]) -> None:
        """Loads from a tier only where that was measured cheaper than computing the block."""
        self.costs = dict(costs)
        self.usable = {t for t in ("host", "disk") if t in costs and costs[t] < costs["compute"]}
        ms = ", ".join(f"{t} {1000 * s:.2f} ms" for t, s in costs.items())
        log.info(
            "KV offload tiers, one block: %s; loading from: %s", ms, ", ".join(sorted(self.usable)) or "none"
        )

    def evicted(self, block_id: int, block_hash: int) -> bool:
        """A pool block holding the cached block `block_hash` is being reused: keeps its K/V
        (True: the replica still holds the block, below its pool)."""
        if block_hash in self.host:  # the tier has it already (it was loaded from there)
            self.host.move_to_end(block_hash)
            return True
        if block_hash in self.disk and not self.host_blocks:
            self.disk.move_to_end(block_hash)
            return True
        if not self.host_blocks:
            self._add_disk(block_hash)
            self.moves.append(TierMove("save_disk", block_hash, block_id))
            return True
        if not self.free_slots:
            self._demote_oldest()
        slot = self.free_slots.pop()
        self.host[block_hash] = slot
        self.moves.append(TierMove("save", block_hash, block_id, slot))
        self.saved["host"] += 1
        return True

    def find(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, the tiers hold; those are kept as most recently
        used, so that the evictions of the same admission do not push them out."""
        n = 0
        for h in hashes:
            if h in self.host and "host" in self.usable:
                self.host.move_to_end(h)
            elif h in self.disk and "disk" in self.usable:
                self.disk.move_to_end(h)
            else:
                break
            n += 1
        return n

    def load(self, block_hash: int, block_id: int) -> bool:
        """Orders the block back into pool block `block_id`; False when no tier holds it (any more)."""
        slot = self.host.get(block_hash)
        if slot is not None:
            self.host.move_to_end(block_hash)
            self.moves.append(TierMove("load_host", block_hash, block_id, slot))
            self.loaded["host"] += 1
            return True
        if block_hash in self.disk:
            self.disk.move_to_end(block_hash)
            self.moves.append(TierMove("load_disk", block_hash, block_id))
            self.loaded["disk"] += 1
            return True
        return False

    def _dropped(self, h: int) -> None:
        if self.on_drop is not None:
            self.on_drop(h)

    def where(self, block_hash: int) -> tuple[str, int] | None:
        """("host", slot) or ("disk", hash) for a block a tier holds, or None."""
        if block_hash in self.host:
            return "host", self.host[block_hash]
        if block_hash in self.disk:
            return "disk", block_hash
        return None

    def take_moves(self) -> list[TierMove]:
        moves, self.moves = self.moves, []
        return moves

    def _demote_oldest(self) -> None:
        h, slot = self.host.popitem(last=False)
        if self.disk_blocks and h not in self.disk:
            self._add_disk(h)
            self.moves.append(TierMove("demote", h, host_slot=slot))
        elif h not in self.disk:
            self._dropped(h)
        self.free_slots.append(slot)

    def _add_disk(self, h: int) -> None:
        while len(self.disk) >= self.disk_blocks:
            old, _ = self.disk.popitem(last=False)
            self.moves.append(TierMove("drop", old))
            if old not in self.host:
                self._dropped(old)
        self.disk[h] = None
        self.saved["disk"] += 1
