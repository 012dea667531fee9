"""Property tests: random allocate / append / fork / free / evict sequences keep the block pool's
ref counts, free list and hash index consistent."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shoal.engine.block_pool import BlockPool
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request
from shoal.engine.sampling_params import SamplingParams
from shoal.protocol.block_hash import hash_blocks

BLOCK = 4
# A tiny alphabet makes shared prefixes (and so cache hits) common.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(24, enable_caching=True, enable_events=True)
        self.kv = KVCacheManager(self.pool, BLOCK)
        self.live: dict[str, Request] = {}
        self.counter = 0
        self.stored: set[int] = set()

    def _new_request(self, ids: list[int]) -> Request:
        self.counter += 1
        return Request(f"r{self.counter}", ids, SamplingParams(), max_tokens=100, seed=0)

    @rule(ids=tokens)
    def allocate(self, ids):
        req = self._new_request(ids)
        cached = self.kv.find_cached_prefix(req)
        n = req.num_tokens - len(cached) * BLOCK
        assert n >= 1
        free = self.pool.num_free_blocks
        if self.kv.allocate_slots(req, n, cached=cached) is None:
            assert self.pool.num_free_blocks == free and req.request_id not in self.kv.tables
            return
        req.num_computed_tokens = len(cached) * BLOCK + n
        self.kv.commit(req)
        self.live[req.request_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=tokens)
    def append(self, data, extra):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.token_ids.extend(extra)
        if self.kv.allocate_slots(req, len(extra)) is None:
            del req.token_ids[-len(extra) :]
            return
        req.num_computed_tokens += len(extra)
        self.kv.commit(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = self._new_request(parent.token_ids)
        child.num_computed_tokens = self.kv.fork(parent, child)
        n = child.num_tokens - child.num_computed_tokens
        if self.kv.allocate_slots(child, n) is None:
            self.kv.free(child)
            return
        child.num_computed_tokens += n
        self.kv.commit(child)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(req)

    @rule()
    def evict_all_unused(self):
        self.pool.reset_prefix_cache()

    @invariant()
    def ref_counts_match_tables(self):
        refs = Counter(b.block_id for table in self.kv.tables.values() for b in table)
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0)
        for table in self.kv.tables.values():
            assert len({b.block_id for b in table}) == len(table)

    @invariant()
    def free_list_is_exactly_the_unreferenced_blocks(self):
        free = [b.block_id for b in self.pool.free_queue]
        assert len(free) == len(set(free)) == self.pool.num_free_blocks
        assert set(free) == {b.block_id for b in self.pool.blocks if b.ref_cnt == 0}

    @invariant()
    def hash_index_is_consistent(self):
        for h, b in self.pool.cached.items():
            assert b.block_hash == h
        hashed = [b for b in self.pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.pool.cached)

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self):
        for req in self.live.values():
            table = self.kv.tables[req.request_id]
            expected = hash_blocks(req.token_ids[: req.num_computed_tokens], BLOCK)
            for block, h in zip(table, expected):
                if block.block_hash is not None:
                    assert block.block_hash == h

    @invariant()
    def events_pair_up(self):
        for e in self.pool.take_events():
            if e.kind == "stored":
                self.stored.add(e.block_hash)
            else:
                assert e.block_hash in self.stored
                self.stored.discard(e.block_hash)
        assert self.stored == set(self.pool.cached)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase
