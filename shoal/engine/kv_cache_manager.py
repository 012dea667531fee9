"""Per-request block tables on top of the block pool: prefix lookup, allocation, caching, fork."""

from __future__ import annotations

from shoal.engine.block_pool import BlockPool, KVBlock
from shoal.engine.kv_connector.packing import PackedKV, checked
from shoal.engine.kv_tiers import KVTierIndex
from shoal.engine.request import Request
from shoal.protocol.block_hash import NONE_HASH, hash_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, block_size: int, root_hash: int = NONE_HASH, tiers: KVTierIndex | None = None
    ):
        self.pool = pool
        self.tiers = tiers  # where evicted prefix blocks go, and come back from
        if tiers is not None:
            pool.on_evict = tiers.evicted
            tiers.on_drop = pool.tier_dropped
        self.block_size = block_size
        self.root_hash = root_hash
        self.tables: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request have been offered to the prefix cache.
        self.num_committed: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _hashes(self, req: Request, num_tokens: int) -> list[int]:
        return hash_blocks(
            req.token_ids[:num_tokens], self.block_size, req.extra_keys, req.block_hashes, self.root_hash
        )

    def block_hashes(self, req: Request, num_tokens: int) -> list[int]:
        """The hash chain of the request's full blocks among its first num_tokens tokens."""
        return self._hashes(req, num_tokens // self.block_size * self.block_size)

    def find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """Longest run of cached full blocks at the start of the request (never its last token)."""
        if not self.pool.enable_caching:
            return []
        hits = []
        for h in self._hashes(req, req.num_tokens - 1):
            block = self.pool.get_cached(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def find_tiered(self, req: Request, num_cached_blocks: int) -> int:
        """How many full blocks after the request's cached prefix the offload tiers hold."""
        if self.tiers is None or not self.pool.enable_caching:
            return 0
        return self.tiers.find(self._hashes(req, req.num_tokens - 1)[num_cached_blocks:])

    def load_tiered(self, req: Request, first: int, count: int) -> int:
        """Orders blocks first..first+count of the request's table filled from the tiers; returns
        how many leading ones are (a block the same admission pushed out of every tier, and
        those after it, are computed instead)."""
        table = self.tables[req.request_id]
        hashes = self._hashes(req, (first + count) * self.block_size)
        loaded = 0
        for i in range(first, first + count):
            if not self.tiers.load(hashes[i], table[i].block_id):
                break
            loaded += 1
        return loaded

    def held_prefix(self, hashes: list[int]) -> list[tuple[str, int]]:
        """Where each of the leading blocks of a chain that this engine holds is: ("pool", block
        id), or a tier's ("host", slot) or ("disk", hash)."""
        sources = []
        for h in hashes:
            block = self.pool.get_cached(h)
            where = self.tiers.where(h) if block is None and self.tiers is not None else None
            if block is None and where is None:
                break
            sources.append(("pool", block.block_id) if block is not None else where)
        return sources

    def prompt_hashes(self, ids: list[int], extra_keys: tuple = ()) -> list[int]:
        """The chain of a prompt's full blocks before its last token."""
        full = (len(ids) - 1) // self.block_size * self.block_size
        return hash_blocks(ids[:full], self.block_size, extra_keys, root=self.root_hash)

    def check_external(self, req: Request, packed: PackedKV, shape: tuple, dtype) -> PackedKV:
        """K/V from outside for `req`, checked against its own hash chain (ValueError if not)."""
        num = getattr(packed, "num_tokens", 0)
        hashes = self.block_hashes(req, min(num, req.num_tokens)) if isinstance(num, int) else []
        return checked(packed, req.num_tokens, hashes, shape, dtype, self.block_size)

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        num_external_tokens: int = 0,
        cached: list[KVBlock] | tuple = (),
        reserve: int = 0,
    ) -> list[KVBlock] | None:
        """Checks and grows the request's table in one call: room for its computed tokens, the
        cached prefix blocks given (attached first), `num_external_tokens` whose K/V arrives from
        outside the engine, `num_new_tokens` this step computes, and `num_lookahead_tokens`
        speculative slots after them. Returns the blocks added, or None (and changes nothing)
        when the pool, less `reserve` blocks, cannot hold them."""
        table = self.tables.get(req.request_id, [])
        wanted = req.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if table and not cached and not num_external_tokens and wanted <= len(table) * self.block_size:
            return []  # a decode step that fits the blocks it has: the usual case
        if cached:
            assert not table, "cached prefix blocks only attach to an empty table"
        total = (
            req.num_computed_tokens
            + len(cached) * self.block_size
            + num_external_tokens
            + num_new_tokens
            + num_lookahead_tokens
        )
        need = max(0, self.num_blocks_for(total) - len(table) - len(cached))
        # Touching a cached block that sits in the free list takes it out of the free count.
        reclaimed = sum(1 for b in cached if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimed - reserve:
            return None
        table = self.tables.setdefault(req.request_id, [])
        if cached:
            self.pool.touch(cached)
            table.extend(cached)
            self.num_committed[req.request_id] = len(cached)
        added = self.pool.allocate(need) if need else []
        table.extend(added)
        return list(cached) + added

    def commit(self, req: Request) -> None:
        """Offers the request's newly full, computed blocks to the prefix cache."""
        if not self.pool.enable_caching:
            return
        table = self.tables.get(req.request_id)
        if table is None:
            return
        start = self.num_committed.get(req.request_id, 0)
        full = min(req.num_computed_tokens // self.block_size, len(table))
        if full <= start:
            return
        hashes = self._hashes(req, full * self.block_size)
        bs = self.block_size
        for i in range(start, full):
            parent = hashes[i - 1] if i else None
            self.pool.cache_block(table[i], hashes[i], parent, tuple(req.token_ids[i * bs : (i + 1) * bs]))
        self.num_committed[req.request_id] = full

    def fork(self, parent: Request, child: Request) -> int:
        """Shares the parent's full computed blocks with the child; returns tokens shared."""
        table = self.tables[parent.request_id]
        shared = table[: min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size]
        self.pool.touch(shared)
        self.tables[child.request_id] = list(shared)
        self.num_committed[child.request_id] = len(shared)
        return len(shared) * self.block_size

    def free(self, req: Request) -> None:
        table = self.tables.pop(req.request_id, None)
        self.num_committed.pop(req.request_id, None)
        if table:
            # Tail blocks first: they are the least likely to be shared, so they are evicted first.
            self.pool.free(reversed(table))

    def occupancy(self, requests, pending: dict[str, int]) -> tuple[int, int]:
        """(slots holding tokens, slots allocated) over `requests`, counting `pending` tokens as held."""
        used = alloc = 0
        for req in requests:
            capacity = len(self.tables.get(req.request_id, ())) * self.block_size
            alloc += capacity
            used += min(req.num_computed_tokens + pending.get(req.request_id, 0), capacity)
        return used, alloc
