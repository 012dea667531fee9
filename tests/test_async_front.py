"""The async front: the engine thread sends token deltas only; each stream detokenizes and
matches stop strings on its own event loop, hands a found stop back to the engine as a command,
and gives a consumer that lags one merged output instead of a queue of snapshots."""

from __future__ import annotations

import asyncio
import threading

from shoal import LLM, SamplingParams
from shoal.engine.async_engine import AsyncEngine
from shoal.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from shoal.engine.core import EngineCore
from shoal.engine.outputs import EngineCoreOutput
from tests.helpers import assert_pool_whole

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def front_for(bundled):
    cfg = EngineConfig(cache=CacheConfig(num_blocks=128), scheduler=SchedulerConfig(max_num_seqs=4))
    engine = EngineCore(cfg, loaded=bundled)
    decoded_on: set[str] = set()
    decode = engine.tokenizer.decode

    def watched(*args, **kw):  # records which thread turns tokens into text
        decoded_on.add(threading.current_thread().name)
        return decode(*args, **kw)

    engine.tokenizer.decode = watched
    return engine, AsyncEngine(engine).start(), decoded_on


def test_a_lagging_consumer_gets_its_deltas_merged_and_text_is_made_off_the_engine_thread(bundled):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM(loaded=bundled, num_blocks=128).generate(PROMPT, params)[0].outputs[0]
    engine, front, decoded_on = front_for(bundled)

    async def run():
        stream = await front.add_request("lag", PROMPT, params)
        while not any(co.finish_reason for co in stream.pending):  # the consumer sleeps meanwhile
            await asyncio.sleep(0.02)
        held = list(stream.pending)
        outs = [o async for o in stream]
        return held, outs

    try:
        held, outs = asyncio.run(run())
    finally:
        front.shutdown()
    # What waited was the engine's token deltas, one small item a step, not text snapshots.
    assert all(isinstance(co, EngineCoreOutput) for co in held) and len(held) <= 41
    assert sum(len(co.new_token_ids) for co in held) == 40
    (out,) = outs  # merged into one output
    assert out.finished and out.outputs[0].delta_token_ids == want.token_ids
    assert out.outputs[0].delta_text == want.text
    assert "shoal-engine" not in decoded_on and decoded_on
    assert not hasattr(engine, "output_processor")  # the core has no text front to use


def test_a_stop_string_found_by_the_front_finishes_the_request_in_the_engine(bundled):
    engine, front, _ = front_for(bundled)

    async def run():
        stream = await front.add_request(
            "stop", PROMPT, SamplingParams(temperature=0, max_tokens=200, stop=[" the"], ignore_eos=True)
        )
        outs = [o async for o in stream]
        for _ in range(100):  # the stop command reaches the engine between steps
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        return outs

    try:
        outs = asyncio.run(run())
        text = "".join(o.outputs[0].delta_text for o in outs)
        assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == " the"
        assert " the" not in text
        assert sum(len(o.outputs[0].delta_token_ids) for o in outs) < 60
        assert not engine.has_unfinished_requests()
        assert_pool_whole(engine)
        assert not front._streams  # nothing is kept for a request the front finished
    finally:
        front.shutdown()
