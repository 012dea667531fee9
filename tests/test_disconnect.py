"""unless_client_leaves' edges, driven by an ASGI receive of the test's own (the real servers'
disconnects are in test_server_openai and test_fleet): the work's result when it ends first, its
cleanup finished before the 499, and a handler's own cancel passed on as a cancel."""

from __future__ import annotations

import asyncio

import pytest

from shoal.protocol.disconnect import CLIENT_CLOSED, unless_client_leaves
from shoal.protocol.errors import APIError


class Connection:
    """The ASGI receive of a request whose body was read: it answers only when the client goes."""

    def __init__(self):
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def long_work(steps: list[str], cleanup_s: float) -> None:
    """Work that would run a minute; its cleanup (an abort) takes `cleanup_s`, then is noted."""
    try:
        await asyncio.sleep(60)
    finally:
        await asyncio.sleep(cleanup_s)
        steps.append("cleaned up")


def test_work_that_ends_first_gives_its_result_and_its_errors():
    async def run():
        conn = Connection()
        assert await unless_client_leaves(conn.receive, asyncio.sleep(0, result=7)) == 7

        async def fails():
            raise ValueError("engine said no")

        with pytest.raises(ValueError, match="engine said no"):
            await unless_client_leaves(conn.receive, fails())

    asyncio.run(run())


def test_a_client_that_leaves_cancels_the_work_and_its_cleanup_ends_before_the_499():
    async def run():
        conn, steps = Connection(), []
        asyncio.get_running_loop().call_later(0.05, conn.gone.set)
        with pytest.raises(APIError) as err:
            await unless_client_leaves(conn.receive, long_work(steps, 0.01))
        assert err.value.status == CLIENT_CLOSED and steps == ["cleaned up"]

    asyncio.run(run())


def test_a_handler_cancelled_itself_is_cancelled_and_cancels_its_work():
    async def run():
        conn, steps = Connection(), []
        handler = asyncio.ensure_future(unless_client_leaves(conn.receive, long_work(steps, 0)))
        await asyncio.sleep(0.02)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        await asyncio.sleep(0.01)
        assert steps == ["cleaned up"]

        # Also while it waits for the cleanup of a client that left.
        conn = Connection()
        conn.gone.set()
        handler = asyncio.ensure_future(unless_client_leaves(conn.receive, long_work(steps, 0.2)))
        await asyncio.sleep(0.05)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler

    asyncio.run(run())
