"""Graceful drain: on SIGTERM (or a first Ctrl-C) the replica stops taking new generation
requests, lets those in flight finish for up to `--shutdown-timeout`, and only then exits.

While it drains, /ready says so (503, `"draining": true`) and a new completion, chat or
embedding request gets a 503 whose code is `draining`: a gateway takes it elsewhere at once
and moves this replica's streams off it. Its K/V routes stay open, since the replicas that take
those streams copy their context from here. A second signal exits at once."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable

import uvicorn

# Requests a drain waits for and refuses to start: those that run generation or pooling.
ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})
POLL_S = 0.05


class Drain:
    """Counts the requests in flight and, once asked, waits until none is left or time is up."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.inflight = 0
        self.since: float | None = None  # when the drain began
        self._begun = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def draining(self) -> bool:
        return self.since is not None

    def begin(self) -> bool:
        """Starts the drain; False when it had already begun."""
        if self.since is not None:
            return False
        self.since = time.monotonic()
        if self._loop is not None:  # called from a signal handler: wake the loop safely
            self._loop.call_soon_threadsafe(self._begun.set)
        print(
            f"shoal: draining: {self.inflight} requests in flight, up to {self.timeout_s:g} s to finish",
            file=sys.stderr,
            flush=True,
        )
        return True

    async def wait(self, held: Callable[[], int] = lambda: 0) -> bool:
        """Once a drain begins: until the requests in flight are done, and the K/V this prefill
        worker `held` for decode workers has been pulled (True), or the timeout is spent (False)."""
        self._loop = asyncio.get_running_loop()
        if self.since is None:
            await self._begun.wait()
        deadline = self.since + self.timeout_s
        while (self.inflight > 0 or held() > 0) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        done = self.inflight == 0 and held() == 0
        took = time.monotonic() - self.since
        if done:
            print(f"shoal: drained in {took:.1f} s", file=sys.stderr, flush=True)
        else:
            print(
                f"shoal: {self.inflight} requests still in flight after {took:.1f} s; they are cut off",
                file=sys.stderr,
                flush=True,
            )
        return done


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but a first SIGTERM or SIGINT asks for a drain instead of an exit."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], bool]):
        super().__init__(config)
        self.on_signal = on_signal  # starts the drain; False when one had begun already

    def handle_exit(self, sig: int, frame) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT) and not self.should_exit and self.on_signal():
            return
        super().handle_exit(sig, frame)
