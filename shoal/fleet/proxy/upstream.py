"""One request sent to one replica: its deadlines, its interruption when the replica goes down,
and how it ended when it ended badly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from shoal.fleet.config import GatewayConfig
from shoal.fleet.replicas.replica import Replica
from shoal.protocol.errors import DRAINING_CODE, RANK_LOST_CODE
from shoal.protocol.sse import DONE_DATA, event_data, sse_lines

ENCODE_INLINE_BYTES = 64 * 1024  # larger bodies are serialized on a thread

# Errors that prove the request never reached the replica's application: safe to send elsewhere.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.WriteError, httpx.WriteTimeout)


@dataclass
class Outcome:
    """How an attempt failed.

    kind: "migrated" (ended on purpose, to continue on another replica), "not_sent" (connect or
    write failed), "timeout" (our deadline, the replica still up),
    "interrupted" (the replica table marked it down mid-request), "dropped" (the connection
    or stream broke), "engine_dead" (the replica says its engine died under the request),
    "internal_error" (the replica says the request itself failed in the engine), "error" (any
    other error the replica sent in-band)."""

    kind: str
    message: str

    @property
    def is_death(self) -> bool:
        """The replica may have died under the request (its fault or not)."""
        return self.kind in ("interrupted", "dropped", "engine_dead")


class Attempt:
    """Registered with its replica while in flight, so that marking the replica down
    (replicas/table.py) interrupts it."""

    def __init__(self, replica: Replica, priority: int = 0):
        self.replica = replica
        self.priority = priority  # its request's (a larger number: less urgent)
        self.tokens = 0  # output tokens the replica has sent for it
        self.started = time.monotonic()
        self.last_token_at: float | None = None
        self.interrupted = False
        self.migrating = False  # interrupted to move its stream to another replica, not a failure
        self.movable = False  # a stream that can go on elsewhere from where it is (StreamRelay)
        self.on_move: Callable[[], None] | None = None  # its relay's way to move it (copy first)
        self.move_asked = False  # a move is under way (cleared by its relay if it stays)
        self._timeout: asyncio.Timeout | None = None
        replica.attempts.add(self)

    def took_tokens(self, tokens: int, now: float, fresh: bool = True) -> None:
        """Its replica sent `tokens` more: its speed, for the rolling update's judge. Only a
        `fresh` request's first token is a time to first token (a continuation's is not)."""
        self.tokens += tokens
        if self.last_token_at is None:
            if fresh:
                self.replica.latency.first_token(now - self.started, now)
        else:
            self.replica.latency.gap((now - self.last_token_at) / tokens, now)
        self.last_token_at = now

    def move(self) -> None:
        """Moves its stream to another replica: through its relay, which copies the context
        there first, or at once."""
        self.move_asked = True
        if self.on_move is not None:
            self.on_move()
        else:
            self.migrate()

    def migrate(self) -> None:
        """Ends the attempt to continue its stream elsewhere (see StreamRelay.recover)."""
        self.migrating = True
        self.interrupt()

    def interrupt(self) -> None:
        self.interrupted = True
        if self._timeout is not None:
            with contextlib.suppress(RuntimeError):  # it is expiring already
                self._timeout.reschedule(asyncio.get_running_loop().time())

    @contextlib.asynccontextmanager
    async def deadline(self, seconds: float):
        """Raises TimeoutError past `seconds`, or at once when the replica is marked down."""
        async with asyncio.timeout(seconds) as cm:
            self._timeout = cm
            if self.interrupted:
                cm.reschedule(asyncio.get_running_loop().time())
            try:
                yield
            finally:
                self._timeout = None

    def done(self) -> None:
        self.replica.attempts.discard(self)

    def outcome(self, exc: BaseException) -> Outcome:
        if isinstance(exc, TimeoutError):
            if self.migrating:
                return Outcome("migrated", f"the stream moves off replica {self.replica.name}")
            if self.interrupted:
                return Outcome("interrupted", f"replica {self.replica.name} went down")
            return Outcome("timeout", f"replica {self.replica.name} did not answer in time")
        if isinstance(exc, NOT_SENT):
            return Outcome("not_sent", f"replica {self.replica.name}: {type(exc).__name__}")
        if isinstance(exc, InBandError):
            return exc.outcome
        return Outcome("dropped", f"replica {self.replica.name}: {type(exc).__name__}: {exc}")


class InBandError(Exception):
    def __init__(self, outcome: Outcome):
        super().__init__(outcome.message)
        self.outcome = outcome


def error_outcome(body: object) -> Outcome:
    """The outcome an error body from a replica stands for."""
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    code, message = err.get("code"), str(err.get("message") or "error")
    if code == "engine_dead":
        return Outcome("engine_dead", message)
    if code == RANK_LOST_CODE:  # the replica is going down, through no fault of the request
        return Outcome("dropped", message)
    if code == "internal_error":  # a shoal replica's word: the engine failed this request alone
        return Outcome("internal_error", message)
    if code == DRAINING_CODE:  # it shuts down and refused the request before running it
        return Outcome("draining", message)
    return Outcome("error", message)


async def sse_events(
    resp: httpx.Response, attempt: Attempt, first_timeout: float, idle_timeout: float
) -> AsyncIterator[dict]:
    """The JSON events of an SSE response up to [DONE]. Raises on a broken stream (no [DONE]),
    an in-band error, a gap past the timeouts, or the replica marked down."""
    lines = sse_lines(resp.aiter_text())
    timeout = first_timeout
    while True:
        async with attempt.deadline(timeout):
            line = await anext(lines, None)
        if line is None:
            raise httpx.RemoteProtocolError("the stream ended without [DONE]")
        data = event_data(line)
        if data is None:
            continue
        if data == DONE_DATA:
            return
        try:
            obj = json.loads(data)
        except ValueError:
            raise httpx.RemoteProtocolError(f"a malformed event: {data[:80]!r}") from None
        if isinstance(obj, dict) and "error" in obj:
            raise InBandError(error_outcome(obj))
        if not isinstance(obj, dict) or not readable(obj):
            raise httpx.RemoteProtocolError(f"a malformed event: {data[:80]!r}")
        timeout = idle_timeout
        yield obj


def _ids(value: object) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(t, int) for t in value))


def _choice_readable(ch: object) -> bool:
    if not isinstance(ch, dict):
        return False
    delta = ch.get("delta")
    return (
        isinstance(ch.get("index", 0), int)
        and _ids(ch.get("token_ids"))
        and _ids(ch.get("prompt_token_ids"))
        and isinstance(ch.get("text"), str | None)
        and (delta is None or (isinstance(delta, dict) and isinstance(delta.get("content"), str | None)))
    )


def readable(obj: dict) -> bool:
    """Whether a streamed chunk has the shape the relay reads (its choices, their token ids and
    text, its usage): a replica that sends anything else broke its stream, as one cut off would."""
    choices, usage = obj.get("choices"), obj.get("usage")
    if choices is not None and not (isinstance(choices, list) and all(map(_choice_readable, choices))):
        return False
    if usage is not None and not isinstance(usage, dict):
        return False
    details = (usage or {}).get("prompt_tokens_details")
    return _ids(obj.get("prompt_token_ids")) and isinstance(details, dict | None)


class UpstreamClient:
    """The gateway's connections to replicas: requests are sent streamed, and each attempt keeps
    its own deadline (see Attempt.deadline); httpx only bounds connecting."""

    def __init__(self, config: GatewayConfig):
        key = config.replica_key
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=config.connect_timeout_s, pool=config.queue_timeout_s),
            limits=httpx.Limits(max_connections=2000, max_keepalive_connections=500),
            headers={"authorization": f"Bearer {key}"} if key else None,
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    @staticmethod
    async def encode(body: dict, size: int) -> bytes:
        if size > ENCODE_INLINE_BYTES:
            return await asyncio.to_thread(lambda: json.dumps(body, ensure_ascii=False).encode())
        return json.dumps(body, ensure_ascii=False).encode()

    async def send(self, replica: Replica, path: str, content: bytes, headers: dict) -> httpx.Response:
        req = self.http.build_request(
            "POST",
            replica.url + path,
            content=content,
            headers={**headers, "content-type": "application/json"},
        )
        return await self.http.send(req, stream=True)

    async def exchange(
        self, attempt: Attempt, path: str, content: bytes, headers: dict, timeout: float
    ) -> tuple[httpx.Response, bytes]:
        """One unstreamed request on the attempt's replica, within `timeout`: response and body."""
        async with attempt.deadline(timeout):
            resp = await self.send(attempt.replica, path, content, headers)
            try:
                return resp, await resp.aread()
            finally:
                await resp.aclose()
