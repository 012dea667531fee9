"""The pool of KV blocks: ref counts, an O(1) LRU free list, and the prefix-hash index.

A block whose ref count drops to zero goes to the tail of the free list but keeps its hash, so a
later request with the same prefix can take it back (`touch`). Allocation pops from the head, which
evicts the least recently freed cached block and emits a `removed` event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KVEvent:
    kind: str  # "stored" | "removed"
    block_hash: int
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class KVBlock:
    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list with sentinels: append, popleft and remove are O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev
        last.next, block.prev = block, last
        block.next, self.tail.prev = self.tail, block
        self.size += 1

    def popleft(self) -> KVBlock:
        if self.size == 0:
            raise RuntimeError("no free KV blocks")
        block = self.head.next
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_events: bool = False):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.events: list[KVEvent] = []
        self.num_evictions = 0
        # Told (block id, hash) of each cached block that allocation reuses, before it is reused:
        # the offload tiers keep its K/V (engine.kv_tiers), and say True when they do: then the
        # block is not reported removed (it is, once the tiers let it go: `tier_dropped`).
        self.on_evict: Callable[[int, int], bool] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.size

    @property
    def usage(self) -> float:
        return 1.0 - self.free_queue.size / self.num_blocks

    def get_cached(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.size:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.size} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            kept = self.on_evict is not None and block.block_hash is not None
            kept = kept and self.on_evict(block.block_id, block.block_hash)
            self._evict(block, report=not kept)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on blocks found in the prefix cache."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops a reference; blocks are passed in eviction order (first freed is evicted first)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache_block(
        self, block: KVBlock, block_hash: int, parent: int | None, token_ids: tuple[int, ...]
    ) -> bool:
        """Registers a full block under its hash; False when that hash is already cached elsewhere."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.enable_events:
            self.events.append(KVEvent("stored", block_hash, parent, token_ids))
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def reset_prefix_cache(self) -> None:
        for b in list(self.cached.values()):
            if b.ref_cnt == 0:
                self._evict(b)

    def tier_dropped(self, block_hash: int) -> None:
        """The offload tiers let go of a block the pool had passed down: reported removed, unless
        the pool holds it again."""
        if self.enable_events and block_hash not in self.cached:
            self.events.append(KVEvent("removed", block_hash))

    def _evict(self, block: KVBlock, report: bool = True) -> None:
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        if self.cached.get(h) is block:
            del self.cached[h]
            self.num_evictions += 1
            if self.enable_events and report:
                self.events.append(KVEvent("removed", h))
