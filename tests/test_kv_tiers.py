"""KV offload tiers on the bundled model (fp32): a prompt whose blocks were pushed out of a small
pool by other prompts comes back from host memory, from disk, or from disk after host memory
passed it on, and gives the same greedy tokens and logprobs as when it was first computed; the
engine's stats and /metrics count the blocks; without a tier the same prompt is computed again;
the disk tier's folder is gone after shutdown, and a dead process's is removed at start."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shoal.engine.kv_tiers import KVTierIndex
from shoal.engine.sampling_params import SamplingParams
from shoal.llm import LLM
from shoal.server.metrics import ServerMetrics
from tests.helpers import assert_pool_whole

MiB = 1 << 20
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
POOL_BLOCKS = 24  # 73-token prompts take 5 blocks each: five other prompts push the first one out


@pytest.fixture(scope="module")
def prompts(bundled):
    tok = bundled.tokenizer
    first = tok.encode("The history of the river towns along the coast is long and " * 6)
    others = [tok.encode(f"Unrelated text number {i} about something else entirely, " * 6) for i in range(6)]
    assert len(first) == 73
    return first, others


def returning(llm: LLM, prompts):
    """The first prompt's output, and its output again after the others passed through."""
    first, others = prompts
    before = llm.generate([first], PARAMS)[0]
    for o in others:
        llm.generate([o], PARAMS)
    return before, llm.generate([first], PARAMS)[0]


def same(a, b) -> None:
    """The same tokens, and the same logprobs to float rounding: the returning prompt's last
    tokens may take another forward path (fp32 steps past this CPU's crossover run in torch)."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) < 1e-4


def test_without_a_tier_an_evicted_prompt_is_computed_again(bundled, prompts):
    llm = LLM(loaded=bundled, num_blocks=POOL_BLOCKS)
    before, again = returning(llm, prompts)
    assert again.num_cached_tokens == 0
    same(before, again)
    assert llm.engine.stats().kv_offload_saved is None


@pytest.mark.parametrize(
    "tiers, loaded_from",
    [
        (dict(kv_offload_memory=32 * MiB), "host"),
        (dict(disk=True), "disk"),
        (dict(kv_offload_memory=2 * MiB, disk=True), "disk"),  # host memory passes blocks on to disk
    ],
    ids=["host", "disk", "host-then-disk"],
)
def test_an_evicted_prompt_comes_back_from_its_tier_exactly(bundled, prompts, tmp_path, tiers, loaded_from):
    options = {k: v for k, v in tiers.items() if k != "disk"}
    stale = None
    if tiers.get("disk"):
        options["kv_offload_disk"] = (str(tmp_path), "256MiB")
        dead = subprocess.Popen(["true"])
        dead.wait()  # a process that left its folder behind (killed, say)
        stale = tmp_path / "tp0-pp0" / f"shoal-kv-{dead.pid}-x"
        stale.mkdir(parents=True)
        (stale / "0000000000000001.kv").write_bytes(b"old")
    llm = LLM(loaded=bundled, num_blocks=POOL_BLOCKS, **options)
    assert stale is None or not stale.exists()
    before, again = returning(llm, prompts)
    assert before.num_cached_tokens == 0
    assert again.num_cached_tokens == 64  # its 4 full blocks before the last token
    same(before, again)
    costs = llm.engine.core.kv.tiers.costs  # timed at start: a load against computing the block
    assert costs[loaded_from] < costs["compute"]
    stats = llm.engine.stats()
    assert stats.kv_offload_loaded == {loaded_from: 4}
    assert stats.kv_offload_saved[loaded_from] >= 4
    metrics = ServerMetrics("m", llm.engine.stats).render().decode()
    line = f'shoal:kv_offload_loaded_blocks_total{{model_name="m",tier="{loaded_from}"}} 4.0'
    assert line in metrics, metrics
    assert_pool_whole(llm.engine)
    if tiers.get("disk"):
        [folder] = list(tmp_path.glob("tp0-pp0/shoal-kv-*"))
        assert any(folder.iterdir())  # the blocks' files
        llm.engine.shutdown()
        assert not Path(folder).exists()


def test_a_tier_measured_slower_than_computing_is_not_loaded_from():
    index = KVTierIndex(host_blocks=2, disk_blocks=4)
    for block_id, block_hash in enumerate([11, 12, 13]):
        index.evicted(block_id, block_hash)  # the third passes the first on to disk
    assert list(index.host) == [12, 13] and list(index.disk) == [11]
    assert [m.kind for m in index.take_moves()] == ["save", "save", "demote", "save"]
    assert index.find([11, 12, 13]) == 3
    index.calibrate({"host": 0.5, "disk": 0.001, "compute": 0.01})
    assert index.usable == {"disk"}
    assert index.find([11, 12, 13]) == 1  # block 12 sits in host memory, slower than computing it


def test_a_block_in_a_tier_is_still_held_in_the_kv_events_until_the_tiers_let_it_go(bundled, prompts):
    """The fleet routes by these events: a prefix pushed down to a tier is still this replica's."""
    first, others = prompts

    def first_then_others(memory: int) -> tuple[LLM, set[int], set[int]]:
        """The first prompt's stored blocks, and the blocks reported removed as the others pass."""
        llm = LLM(loaded=bundled, num_blocks=POOL_BLOCKS, enable_kv_events=True, kv_offload_memory=memory)
        llm.generate([first], PARAMS)
        mine = {e.block_hash for e in llm.engine.take_kv_events() if e.kind == "stored"}
        for o in others:
            llm.generate([o], PARAMS)
        removed = {e.block_hash for e in llm.engine.take_kv_events() if e.kind == "removed"}
        return llm, mine, removed

    kept, mine, removed = first_then_others(64 * MiB)
    assert kept.engine.stats().kv_offload_saved["host"] >= len(mine) and not removed  # all held below
    # With room for two blocks below, the tier lets most go, and says so.
    _, mine, removed = first_then_others(2 * MiB)
    assert mine <= removed
