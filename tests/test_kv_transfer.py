"""A request's K/V moved from one engine to another (the core of prefill/decode disaggregation):
the bytes that arrive are what prefill computed, block by block, and decode goes on as if one
engine had done it all."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.engine.kv_connector.packing import token_slots
from shoal.engine.kv_connector.transports import choose, sees_shm_probe, shm_probe
from shoal.engine.llm_engine import RequestRejectedError
from shoal.protocol.kv_files import PROBE_PREFIX, SHM_DIR, SHM_NAME, shm_sweep, shm_unlink
from tests.conftest import REF_TOKENS
from tests.helpers import PROMPTS, assert_pool_whole, run_to_completion

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(bundled):
    prefill = LLM(loaded=bundled, num_blocks=128).engine
    decode = LLM(loaded=bundled, num_blocks=96).engine
    # Some blocks of the decode pool in use first, so that the request lands on other block ids.
    decode.add_request("other", "Hello there, how are you today?", SamplingParams(max_tokens=2))
    run_to_completion(decode)
    return prefill, decode


def _prefill(engine, rid: str, ids: list[int]):
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, **GREEDY), hold_kv=True)
    first = run_to_completion(engine)[rid].outputs[0].token_ids
    return first, engine.core.export_kv(rid)


def _kv_at(engine, rid_blocks: list[int], n: int) -> torch.Tensor:
    runner = engine.core.executor.runner
    slots = token_slots(rid_blocks, n, runner.block_size, runner.device)
    return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in runner.kv_caches])


@pytest.mark.parametrize("prompt", [PROMPTS[6], PROMPTS[1], PROMPTS[0]])
def test_kv_moves_bit_for_bit_and_decode_goes_on_as_one_engine(engines, bundled, prompt):
    prefill, decode = engines
    ids = bundled.tokenizer.encode(prompt)
    whole = LLM(loaded=bundled, num_blocks=64).generate(ids, SamplingParams(max_tokens=REF_TOKENS, **GREEDY))
    first, packed = _prefill(prefill, "p", ids)
    assert packed.num_tokens == len(ids) and len(packed.block_hashes) == len(ids) // 16
    assert packed.data.shape == (30, 2, len(ids), 3, 64)
    computed = _kv_at(prefill, prefill.core.kv.block_ids("p"), len(ids))

    decode.add_request(
        "d", ids, SamplingParams(max_tokens=REF_TOKENS, **GREEDY), prior_output_ids=first, external_kv=packed
    )
    decode.step()  # loads the K/V, then decodes the first token after it
    arrived = _kv_at(decode, decode.core.kv.block_ids("d"), len(ids))
    assert decode.core.kv.block_ids("d")[0] != prefill.core.kv.block_ids("p")[0] or len(ids) < 16
    for b in range(0, len(ids), 16):  # per block: exactly the bytes prefill computed
        assert torch.equal(arrived[:, :, b : b + 16], computed[:, :, b : b + 16]), b
    # The output counts the prefill's first token as its own (prior output), then what came after.
    got = run_to_completion(decode)["d"].outputs[0].token_ids
    assert got[:1] == first and got == whole[0].outputs[0].token_ids

    # The blocks that arrived feed the decode engine's prefix cache.
    decode.add_request("again", ids, SamplingParams(max_tokens=1, **GREEDY))
    assert run_to_completion(decode)["again"].num_cached_tokens == len(ids) // 16 * 16
    assert prefill.core.release_kv("p") and not prefill.core.release_kv("p")
    assert_pool_whole(prefill)
    assert_pool_whole(decode)


def test_kv_that_does_not_fit_the_request_is_refused_and_changes_nothing(engines, bundled):
    prefill, decode = engines
    ids = bundled.tokenizer.encode(PROMPTS[1])
    _, packed = _prefill(prefill, "p2", ids)
    other = bundled.tokenizer.encode(PROMPTS[4])
    bad = {
        "another prompt": (other, packed),
        "wrong shape": (ids, dataclasses.replace(packed, data=packed.data[:, :, :, :2])),
        "wrong dtype": (ids, dataclasses.replace(packed, data=packed.data.half())),
        "count mismatch": (ids, dataclasses.replace(packed, num_tokens=packed.num_tokens - 1)),
        "not a tensor": (ids, dataclasses.replace(packed, data=[1, 2, 3])),
    }
    for why, (prompt, kv) in bad.items():
        with pytest.raises(RequestRejectedError) as err:
            decode.add_request(
                "bad", prompt, SamplingParams(max_tokens=4), prior_output_ids=[1], external_kv=kv
            )
        assert err.value.param == "kv_transfer_params", why
    prefill.core.release_kv("p2")
    assert_pool_whole(prefill)
    assert_pool_whole(decode)


def test_async_engines_hand_kv_over_and_kv_nobody_takes_is_freed(bundled):
    """The same handoff through the async front, and held K/V that no decode engine takes is freed
    after kv_hold_timeout_s. The K/V is packed as the prefill finishes: a pull is answered while
    the engine thread is busy (a prefill step of other prompts), with the bits the engine holds."""
    from shoal.engine.async_engine import AsyncEngine, AsyncEngineConfig
    from shoal.engine.config import CacheConfig, EngineConfig
    from shoal.engine.core import EngineCore

    def front():
        engine = EngineCore(EngineConfig(cache=CacheConfig(num_blocks=96)), loaded=bundled)
        return engine, AsyncEngine(engine, AsyncEngineConfig(kv_hold_timeout_s=1.0)).start()

    (p_engine, prefill), (d_engine, decode) = front(), front()
    ids = bundled.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(max_tokens=12, **GREEDY)
    want = LLM(loaded=bundled, num_blocks=64).generate(ids, params)[0].outputs[0].token_ids

    async def tokens(stream) -> list[int]:
        return [t async for out in stream for t in out.outputs[0].delta_token_ids]

    async def run():
        one = SamplingParams(max_tokens=1, **GREEDY)
        first = await tokens(await prefill.add_request("p", ids, one, hold_kv=True))
        busy, free = threading.Event(), threading.Event()
        occupied = asyncio.ensure_future(prefill._call(lambda: (busy.set(), free.wait(30))))
        await asyncio.to_thread(busy.wait, 30)  # the engine thread is taken until `free` is set
        packed = await asyncio.wait_for(prefill.export_kv("p"), 10)
        free.set()
        await occupied
        held = await prefill._call(lambda: p_engine.export_kv("p"))
        assert held.num_tokens == packed.num_tokens and torch.equal(held.data, packed.data)
        stream = await decode.add_request("d", ids, params, prior_output_ids=first, external_kv=packed)
        rest = await tokens(stream)
        assert await prefill.release_kv("p")
        with pytest.raises(KeyError):  # released: its packed copy is gone too
            await prefill.export_kv("p")
        await tokens(await prefill.add_request("q", ids, one, hold_kv=True))
        await asyncio.sleep(1.8)  # nobody takes q's K/V
        assert prefill.load()["kv_held"] == 0 and prefill.load()["kv_usage"] == 0  # and the load shows it
        with pytest.raises(KeyError):
            await prefill.export_kv("q")
        return first, rest

    try:
        first, rest = asyncio.run(run())
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert first + rest == want
    assert_pool_whole(p_engine)
    assert_pool_whole(d_engine)


def test_shared_memory_is_chosen_by_finding_the_peers_probe_file():
    """A puller uses /dev/shm only when the prefill worker's probe is there for it to read; a
    probe name from the wire is never a path outside the transfer files."""
    probe = shm_probe()
    assert probe is not None and sees_shm_probe(probe)
    assert choose("auto", probe).name == "shm"
    (SHM_DIR / probe).write_text("someone else's")  # same name, other content: not our peer's file
    assert choose("auto", probe).name == "tcp"
    shm_unlink(probe)
    assert not sees_shm_probe(probe) and choose("auto", probe).name == "tcp"  # gone: another host
    for hostile in (None, 3, "../../etc/hostname", "/etc/hostname", "shoal-kv-1-zz"):
        assert choose("auto", hostile).name == "tcp"
    assert choose("tcp", probe).name == "tcp"
    # A probe is not K/V (no transfer file is left by a live worker's probe), and the sweep of the
    # next worker on the host removes a dead worker's.
    assert probe.startswith(PROBE_PREFIX) and not SHM_NAME.fullmatch(probe)
    dead = f"{PROBE_PREFIX}{2**31 - 7}-{'ab' * 16}"
    (SHM_DIR / dead).write_text(dead)
    shm_sweep()
    assert not (SHM_DIR / dead).exists()
