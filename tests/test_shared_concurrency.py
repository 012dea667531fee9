"""The concurrency places gateways share through one real redis-server on 127.0.0.1 (Debian's
package): the once-a-second heal that writes a gateway's places over the store's never counts a
place twice, never brings one back, never loses one, and still mends a count the store lost."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from shoal.fleet.admission.shared_concurrency import SharedConcurrency
from shoal.fleet.admission.store import StoreHealth, connect


def tenant(name: str, limit: int) -> SimpleNamespace:
    """What SharedConcurrency reads of a tenant; `inflight` as the gateway's admission counts it
    (one more from its local admission on, before the store is asked)."""
    return SimpleNamespace(name=name, inflight=0, config=SimpleNamespace(max_concurrency=limit))


def places_in(url: str, prefix: str) -> SharedConcurrency:
    """A gateway's shared places: a store client of its own, as each gateway has."""
    return SharedConcurrency(connect(url, 1.0), StoreHealth(url), prefix)


async def field(places: SharedConcurrency, t) -> int:
    return int(await places.client.hget(f"{places.prefix}{t.name}", places.id) or 0)


async def admission(places: SharedConcurrency, t, pause: bool = False) -> int:
    t.inflight += 1  # admitted by this gateway, on its way to the store
    if pause:  # other work may run before the store is asked
        await asyncio.sleep(0)
    return await places.enter(t)


def test_a_heal_beside_an_admission_counts_its_place_once(redis_store):
    """A gateway's first request opens a store connection, and so does the heal beside it: either
    may land first. Written first, the heal must not count the place its admission then adds."""

    async def run() -> list[tuple[int, int]]:
        seen = []
        for i in range(100):
            places = places_in(redis_store, f"once{i}:")
            t = tenant("solo", 1)

            held, _ = await asyncio.gather(admission(places, t), places._heal())
            seen.append((held, await field(places, t)))
            await places.client.aclose()
        return seen

    seen = asyncio.run(run())
    assert seen == [(-1, 1)] * 100  # taken, and held once


def test_two_gateways_under_heals_never_pass_the_limit_and_end_holding_nothing(redis_store):
    """Eight requests a gateway, two gateways, a limit of 3, heals as often as the loop allows:
    the places taken never pass 3, and once every request has left, the store holds none."""
    limit = 3

    async def run():
        gateways = [places_in(redis_store, "busy:") for _ in range(2)]
        tenants = [tenant("shared", limit) for _ in gateways]
        for places in gateways:
            await places.gateways.beat(places.id, 60)
        taken = {"now": 0, "most": 0, "times": 0, "refused": 0}
        stop = asyncio.Event()
        rng = random.Random(7)

        async def request(places, t):
            while not stop.is_set():
                if await admission(places, t, pause=True) >= 0:
                    t.inflight -= 1
                    taken["refused"] += 1
                    continue
                taken["now"] += 1
                taken["most"] = max(taken["most"], taken["now"])
                taken["times"] += 1
                await asyncio.sleep(rng.random() * 0.003)
                taken["now"] -= 1
                t.inflight -= 1
                places.leave(t)

        async def healing(places):
            while not stop.is_set():
                await places._heal()
                await asyncio.sleep(rng.random() * 0.002)

        tasks = [
            asyncio.create_task(job)
            for places, t in zip(gateways, tenants)
            for job in [*(request(places, t) for _ in range(8)), healing(places)]
        ]
        await asyncio.sleep(4)
        stop.set()
        await asyncio.gather(*tasks)
        for places in gateways:
            while places._releases:
                await asyncio.sleep(0.01)
        return taken, [await field(p, t) for p, t in zip(gateways, tenants)]

    taken, left = asyncio.run(run())
    assert taken["most"] <= limit, taken
    assert taken["times"] > 200 and taken["refused"] > 0, taken  # the limit was reached, often
    assert left == [0, 0], taken


def test_a_count_the_store_lost_comes_back_within_a_heal(redis_store):
    """A store restarted empty forgets the places held; one left with a release that never came
    keeps one too many. The next beat writes what this gateway holds."""

    async def run():
        places = places_in(redis_store, "lost:")
        t = tenant("mended", 4)
        await places.start()
        try:
            for _ in range(2):
                t.inflight += 1
                assert await places.enter(t) == -1
            key = f"{places.prefix}{t.name}"
            await places.client.hdel(key, places.id)  # lost
            forgotten = await field(places, t)
            await asyncio.sleep(1.5)
            mended = await field(places, t)
            await places.client.hincrby(key, places.id, 3)  # a release the store never saw
            await asyncio.sleep(1.5)
            return forgotten, mended, await field(places, t)
        finally:
            await places.stop()

    assert asyncio.run(run()) == (0, 2, 2)
