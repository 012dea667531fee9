"""The scheduler on its own: pure Python, no model. The step's results are made up here (the
tokens a runner would sample), and every step's output must be plain data a worker process
could take: what runs, which proposed tokens ride along, and only the block-table changes."""

from __future__ import annotations

import pickle

from shoal.engine.block_pool import BlockPool
from shoal.engine.config import SchedulerConfig
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request, RequestStatus
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.scheduler import Scheduler
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

BS = 4
EOS = 99


def make(num_blocks=32, budget=64, max_seqs=8, caching=True, max_model_len=256) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, caching), BS)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, admission_watermark=0)
    return Scheduler(cfg, kv, max_model_len, frozenset({EOS}))


def req(rid: str, n: int, max_tokens=8, priority=0, start=None, **params) -> Request:
    """A request of n prompt tokens, distinct from other requests' unless `start` says so."""
    start = start if start is not None else 100 * (1 + sum(map(ord, rid)) % 50)
    p = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, list(range(start, start + n)), p, max_tokens=max_tokens, seed=1, priority=priority)


class Worker:
    """What a runner keeps from the step messages: block tables, built from deltas alone."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def take(self, so: SchedulerOutput) -> SchedulerOutput:
        so = pickle.loads(pickle.dumps(so))  # it must cross a process boundary as it is
        for rid in so.finished_ids:
            self.tables.pop(rid, None)
        for new in so.new_requests:
            self.tables[new.request_id] = list(new.block_ids)
        for sr in so.scheduled:
            self.tables[sr.request_id] += sr.new_block_ids
        return so


def step(s: Scheduler, w: Worker, tokens=None, proposed=None) -> SchedulerOutput:
    """One step; each sampling request gets tokens[rid] (default: one token, 7)."""
    so = w.take(s.schedule())
    assert so.num_batched_tokens <= s.cfg.max_num_batched_tokens
    assert len(so.scheduled) <= s.cfg.max_num_seqs
    for sr in so.scheduled:  # the worker's tables are the scheduler's, from deltas alone
        assert w.tables[sr.request_id] == s.kv.block_ids(sr.request_id)
    result = ModelRunnerOutput()
    for sr in so.scheduled:
        if sr.sample:
            result.sampled[sr.request_id] = (tokens or {}).get(sr.request_id, [7])
    result.proposed = dict(proposed or {})
    s.update_from_output(so, result)
    return so


def test_budget_chunks_long_prompts_and_decodes_go_first():
    s, w = make(budget=10), Worker()
    s.add_request(req("a", 23))
    so = step(s, w)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in so.scheduled] == [("a", 10, False)]
    so = step(s, w)
    assert [(len(c.token_ids), c.start_pos) for c in so.scheduled] == [(10, 10)]
    s.add_request(req("b", 6, start=100))
    so = step(s, w)  # a finishes its prompt (3 tokens) and samples; b gets the rest of the budget
    assert [(c.request_id, len(c.token_ids), c.sample) for c in so.scheduled] == [
        ("a", 3, True),
        ("b", 6, True),
    ]
    so = step(s, w)
    assert [(c.request_id, len(c.token_ids)) for c in so.scheduled] == [("a", 1), ("b", 1)]
    assert so.num_batched_tokens == 2
    # Only blocks added since the last step travel: a decode that crosses a block boundary.
    assert all(len(c.new_block_ids) <= 1 for c in so.scheduled)


def test_block_tables_travel_as_deltas():
    s, w = make(), Worker()
    s.add_request(req("a", 5, max_tokens=20))
    first = step(s, w)
    assert (
        first.new_requests[0].block_ids == s.kv.block_ids("a") and len(first.new_requests[0].block_ids) == 2
    )
    sizes = []
    for _ in range(10):
        so = step(s, w)
        assert not so.new_requests
        sizes.append(len(so.scheduled[0].new_block_ids))
    assert sizes.count(1) >= 2 and set(sizes) <= {0, 1}  # one new block every BS tokens, else none


def test_stops_are_decided_token_by_token_from_data():
    s, w = make(), Worker()
    s.add_request(req("eos", 3))
    s.add_request(req("ids", 3, stop_token_ids=[42]))
    s.add_request(req("len", 3, max_tokens=2))
    s.add_request(req("min", 3, min_tokens=3))
    step(s, w, tokens={"eos": [5], "ids": [5], "len": [5], "min": [EOS]})
    assert s.requests["min"].status == RequestStatus.RUNNING  # EOS before min_tokens does not stop
    step(s, w, tokens={"eos": [EOS], "ids": [42], "len": [5], "min": [5]})
    assert "eos" not in s.requests and "ids" not in s.requests and "len" not in s.requests
    assert s.num_unfinished == 1


def test_lookahead_slots_ride_along_and_accepted_tokens_count_as_computed():
    s, w = make(), Worker()
    r = req("a", 6, max_tokens=10)
    s.add_request(r)
    step(s, w, tokens={"a": [1]}, proposed={"a": [2, 3, 4]})
    assert r.spec_token_ids == [2, 3, 4]
    so = step(s, w, tokens={"a": [2, 3, 8]}, proposed={"a": [9, 9, 9]})  # 2 of 3 accepted, then 8
    (c,) = so.scheduled
    assert c.token_ids == [1] and c.spec_token_ids == [2, 3, 4] and so.num_batched_tokens == 4
    # Slots for every proposed token were allocated with the step.
    assert len(s.kv.block_ids("a")) * BS >= c.start_pos + 4
    assert r.output_token_ids == [1, 2, 3, 8] and r.num_computed_tokens == 6 + 3
    assert r.num_tokens - r.num_computed_tokens == 1  # only the model's own token waits
    # Never more tokens than max_tokens allows: 6 are out, 4 may come, so 3 proposals at most.
    so = step(s, w, tokens={"a": [9, 9, 5]}, proposed={"a": [1, 2, 3, 4, 5, 6]})
    (c,) = so.scheduled
    assert len(c.spec_token_ids) == 3
    so = step(s, w, tokens={"a": [1, 2, 3, 4]})
    assert r.is_finished and r.num_output_tokens == 10 and r.status == RequestStatus.FINISHED_LENGTH


def test_a_stop_inside_accepted_tokens_drops_the_rest():
    s, w = make(), Worker()
    r = req("a", 4, max_tokens=20)
    s.add_request(r)
    step(s, w, tokens={"a": [1]}, proposed={"a": [2, EOS, 3]})
    step(s, w, tokens={"a": [2, EOS, 3, 4]})
    assert r.is_finished and r.output_token_ids == [1, 2, EOS]


def test_proposals_give_way_before_anyone_is_preempted():
    s, w = make(num_blocks=4, budget=64), Worker()
    a, b = req("a", 7, max_tokens=8), req("b", 7, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    step(s, w, tokens={"a": [1], "b": [1]}, proposed={"a": [2, 3, 4, 5], "b": [2, 3, 4, 5]})
    # 8 tokens each fill their 2 blocks: no room for lookahead, and none is taken from b.
    so = step(s, w)
    assert {c.request_id: c.spec_token_ids for c in so.scheduled} == {"a": [], "b": []}
    assert s.num_preemptions == 0


def test_preemption_frees_and_recomputes_and_the_worker_hears_it_as_new():
    s, w = make(num_blocks=6, budget=64), Worker()
    low, high = req("low", 9, max_tokens=10, priority=5), req("high", 9, max_tokens=10, priority=0)
    s.add_request(low)
    s.add_request(high)
    resumed = []
    for _ in range(100):
        if not s.num_unfinished:
            break
        had = list(low.output_token_ids)
        so = step(s, w)
        resumed += [(n.output_token_ids, had) for n in so.new_requests if n.request_id == "low" and had]
    assert low.is_finished and high.is_finished
    assert low.num_preemptions >= 1 and high.num_preemptions == 0  # the worse priority gives way
    # The worker forgot it and heard of it again as new, with the output it had, to recompute.
    assert resumed and all(got == had for got, had in resumed)
    assert low.num_output_tokens == high.num_output_tokens == 10
    assert s.kv.pool.num_free_blocks == 6


def test_abort_frees_blocks_and_tells_the_worker():
    s, w = make(), Worker()
    s.add_request(req("a", 9))
    step(s, w)
    free = s.kv.pool.num_free_blocks
    assert [r.request_id for r in s.abort("a")] == ["a"]
    assert s.kv.pool.num_free_blocks > free
    so = step(s, w)
    assert so.empty and so.finished_ids == ["a"] and "a" not in w.tables


def test_external_tokens_get_slots_without_being_computed_here():
    kv = KVCacheManager(BlockPool(8, True), BS)
    r = req("a", 10)
    added = kv.allocate_slots(r, 1, num_external_tokens=9)
    assert added is not None and len(kv.block_ids("a")) == 3  # 9 arriving + 1 computed here
    assert r.num_computed_tokens == 0
    # Check and allocate are one call: too much changes nothing.
    free = kv.pool.num_free_blocks
    assert kv.allocate_slots(req("b", 4), 4, num_external_tokens=100) is None
    assert kv.pool.num_free_blocks == free and "b" not in kv.tables


def test_a_better_priority_prompt_has_its_steps_to_itself():
    s, w = make(budget=8), Worker()
    batch = [req(f"b{i}", 4, max_tokens=20, priority=100) for i in range(2)]
    for r in batch:
        s.add_request(r)
    step(s, w)  # both prefill
    assert [sr.request_id for sr in step(s, w).scheduled] == ["b0", "b1"]  # decoding
    s.add_request(req("late-batch", 4, priority=100))
    s.add_request(urgent := req("chat", 12, max_tokens=2, priority=0))
    first = step(s, w)
    assert [sr.request_id for sr in first.scheduled] == ["chat"]  # a chunk of 8, alone
    second = step(s, w)
    assert [sr.request_id for sr in second.scheduled] == ["chat"]  # the rest of its prompt, alone
    third = step(s, w)  # decoding now: the batch work rides along again
    assert {sr.request_id for sr in third.scheduled} >= {"chat", "b0", "b1"}
    assert urgent.num_output_tokens >= 1 and all(r.num_preemptions == 0 for r in batch)
    while s.num_unfinished:
        step(s, w)
    assert s.kv.pool.num_free_blocks == 32


def test_a_request_sits_out_a_bounded_number_of_steps():
    from shoal.engine.scheduler import HOLD_STEPS

    s, w = make(budget=16, num_blocks=64), Worker()
    s.add_request(low := req("low", 2, max_tokens=50, priority=9))
    step(s, w)
    ran = []
    for i in range(HOLD_STEPS + 2):  # a better prompt arrives at every step
        s.add_request(req(f"chat{i}", 2, max_tokens=1, priority=0, start=1000 + 10 * i))
        ran.append(any(sr.request_id == "low" for sr in step(s, w).scheduled))
    assert ran[:HOLD_STEPS] == [False] * HOLD_STEPS and ran[HOLD_STEPS]  # then it runs once anyway
    assert low.num_preemptions == 0
