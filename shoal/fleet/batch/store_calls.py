"""The batch lane's calls to its store (SQLite, or the Redis several gateways share), on threads of
their own: a store behind a cut link answers nothing until its timeout, and the threads it holds
meanwhile must not be those the gateway parses large bodies and hashes prompts on (asyncio's
default pool). Once the store fails to answer, calls fail at once (503) while one call a second
tries it again: a client is told in no time, and no thread piles up behind a dead link."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

from shoal.fleet.admission.store import store_errors
from shoal.protocol.errors import APIError

log = logging.getLogger(__name__)

THREADS = 4  # the runner's few calls in flight (a claim, finishes) and the API's beside them
RETRY_S = 1.0  # while the store is away, one call tries it again this often


class StoreUnavailable(APIError):
    def __init__(self, reason: str):
        super().__init__(
            503,
            f"the batch store did not answer ({reason[:200]}); try again shortly",
            code="store_unavailable",
            headers={"Retry-After": "1"},
        )


class StoreCalls:
    def __init__(self, shown_store: str):
        """`shown_store`: the store as the log names it."""
        self.shown_store = shown_store
        self.errors = (*store_errors(), sqlite3.OperationalError)
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="batch-store")
        self._away: str | None = None  # what the last failure said, while away
        self._next_try = 0.0
        self._trying = False

    async def __call__(self, fn, *args):
        """fn(*args) on the store's threads; StoreUnavailable if the store fails to answer, or is
        away and this call is not the one that tries it again."""
        trying = self._away is not None
        if trying:
            if self._trying or time.monotonic() < self._next_try:
                raise StoreUnavailable(self._away)
            self._trying = True
        try:
            out = await asyncio.get_running_loop().run_in_executor(self._pool, self._run, trying, fn, args)
        except self.errors as exc:
            reason = str(exc) or type(exc).__name__
            if self._away is None:
                log.warning("batch store %s did not answer: %s", self.shown_store, reason)
            self._away, self._next_try = reason, time.monotonic() + RETRY_S
            raise StoreUnavailable(reason) from exc
        finally:
            if trying:
                self._trying = False
        if self._away is not None:
            self._away = None
            log.warning("batch store %s answers again", self.shown_store)
        return out

    def _run(self, trying: bool, fn, args: tuple):
        """On a store thread: a call that queued there while the store went away fails now."""
        away = self._away
        if away is not None and not trying:
            raise StoreUnavailable(away)
        return fn(*args)

    def close(self) -> None:
        """Lets go of the threads; one stuck on a dead link ends at the store's timeout."""
        self._pool.shutdown(wait=False, cancel_futures=True)
