"""A request's work, cancelled the moment its client goes away.

A streamed answer learns of it from the ASGI server (Starlette listens while it streams); a
non-streamed one has nothing to send until it is done, so without this a client that left would
still have its whole answer computed. The ASGI server's `http.disconnect` message wakes the
listener at once: no polling interval to wait out, and no step of the engine spent on nobody."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from shoal.protocol.errors import APIError

T = TypeVar("T")

# nginx's code for "client closed request": the answer nobody reads, but logs and metrics do.
CLIENT_CLOSED = 499


def client_left() -> APIError:
    return APIError(CLIENT_CLOSED, "the client closed the connection", code="client_disconnected")


async def until_disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Returns when the ASGI server says the client disconnected (call once the body is read:
    body messages read here would be lost to the handler)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(receive: Callable[[], Awaitable[dict[str, Any]]], work: Awaitable[T]) -> T:
    """`work`'s result; if the client leaves first, `work` is cancelled, its cleanup awaited (the
    engine's abort, the replica's lease given back), and `client_left()` raised."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(until_disconnected(receive))
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself (the server stopping)
        listener.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    listener.exception()  # (retrieved) a receive that failed: the connection is gone all the same
    try:
        await task  # its cleanup, done before the handler returns
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise  # this handler's own cancel, not the one it gave its work
    raise client_left()
