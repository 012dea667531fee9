"""The async front of the engine: the step loop runs on its own thread, callers await per-request
streams on their event loop.

Commands (add, abort) cross into the engine thread through a queue and are applied between steps,
so an abort takes effect before the next step. Outputs cross back once per step with one
`call_soon_threadsafe`, as snapshots the engine thread will not touch again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

from shoal.engine.llm_engine import EngineStats, LLMEngine
from shoal.engine.outputs import RequestOutput
from shoal.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineOverloadedError(Exception):
    """The waiting queue is full; retry later."""


class EngineDeadError(Exception):
    """The engine loop has stopped; nothing more will be served."""


@dataclass
class AsyncEngineConfig:
    # Bounds on work admitted but not yet scheduled; past them new requests are refused (503).
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 262_144
    # A step longer than this, with work pending, marks the engine unhealthy.
    stall_timeout_s: float = 60.0
    # KV events kept for routers that poll; one that falls further behind is told to resync.
    kv_event_log_size: int = 200_000


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    tokens: int
    stream: RequestStream
    options: dict


@dataclass
class _Abort:
    request_id: str


_FINISHED = object()


class RequestStream:
    """One request's outputs, in order; the last has `finished` set. Closing it early aborts it."""

    def __init__(self, engine: AsyncEngine, request_id: str, accepted: asyncio.Future):
        self.engine = engine
        self.request_id = request_id
        self.accepted = accepted
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _FINISHED:
            self.finished = True
            raise EngineDeadError("the engine loop stopped while the request ran")
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


def _snapshot(out: RequestOutput, now: float) -> RequestOutput:
    """A copy the engine thread will not mutate. The cumulative token and logprob lists, which it
    keeps growing, are left out: consumers build them from the deltas."""
    outputs = [dataclasses.replace(o, token_ids=[], logprobs=None) for o in out.outputs]
    return dataclasses.replace(out, outputs=outputs, metrics={**out.metrics, "time": now})


class AsyncEngine:
    def __init__(self, engine: LLMEngine, config: AsyncEngineConfig | None = None):
        self.engine = engine
        self.config = config or AsyncEngineConfig()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards the admission counters and the stats snapshot
        self._pending_requests = 0  # submitted, not yet seen by the engine thread
        self._pending_tokens = 0
        self._waiting_requests = 0
        self._waiting_tokens = 0
        self._stats = engine.stats()
        self._step_started: float | None = None
        self._last_step_end = time.monotonic()
        self._stop = threading.Event()
        # (sequence number, event): the fleet router polls this to learn which blocks are cached here.
        self._kv_log: deque = deque(maxlen=self.config.kv_event_log_size)
        self._kv_seq = 0
        self.instance_id = uuid.uuid4().hex  # a restarted replica has a new one: routers drop its old index
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shoal-engine", daemon=True)

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)
        self.engine.shutdown()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def health(self) -> tuple[bool, str]:
        """(healthy, reason): the loop is alive and no step has run past the stall timeout."""
        if not self.is_alive:
            return False, f"engine loop stopped: {self.error!r}" if self.error else "engine loop stopped"
        started = self._step_started
        if started is not None and time.monotonic() - started > self.config.stall_timeout_s:
            return False, f"engine step running for {time.monotonic() - started:.1f} s"
        return True, "ok"

    # --- requests ------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        **options,
    ) -> RequestStream:
        """Admits a request and returns its output stream once the engine has accepted it.
        `options` go to LLMEngine.add_request (a resumed request's prior output).

        Raises the engine's RequestRejectedError for a bad request, EngineOverloadedError when the
        waiting queue is full, EngineDeadError when the loop has stopped.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped")
        # Text is tokenized on the engine thread; until then, a rough count bounds the queue.
        tokens = len(prompt) if isinstance(prompt, list) else len(prompt) // 3 + 1
        self._admit(tokens)
        stream = RequestStream(self, request_id, asyncio.get_running_loop().create_future())
        self._commands.put(_Add(request_id, prompt, params, priority, tokens, stream, options))
        try:
            await stream.accepted
        except BaseException:
            stream.abort()
            raise
        return stream

    def _admit(self, tokens: int) -> None:
        cfg = self.config
        with self._lock:
            requests = self._waiting_requests + self._pending_requests
            queued = self._waiting_tokens + self._pending_tokens
            if requests >= cfg.max_waiting_requests or queued + tokens > cfg.max_waiting_tokens:
                raise EngineOverloadedError(
                    f"the server is at capacity ({requests} requests, {queued} prompt tokens waiting); "
                    "retry shortly"
                )
            self._pending_requests += 1
            self._pending_tokens += tokens

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats

    def load(self) -> dict:
        s = self.stats()
        with self._lock:
            waiting = self._waiting_requests + self._pending_requests
            waiting_tokens = self._waiting_tokens + self._pending_tokens
        return {
            "running": s.num_running,
            "waiting": waiting,
            "waiting_tokens": waiting_tokens,
            "kv_usage": s.kv_usage,
            "free_blocks": s.num_free_blocks,
            "num_blocks": s.num_blocks,
            "num_steps": self.engine.num_steps,
        }

    # --- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_unfinished_requests()
                self._drain(block=idle)
                if self._stop.is_set() or not self.engine.has_unfinished_requests():
                    continue
                self._step_started = time.monotonic()
                outputs = self.engine.step()
                now = self._last_step_end = time.monotonic()
                self._step_started = None
                self._publish_stats()
                self._log_kv_events()
                self._deliver([(o.request_id, _snapshot(o, now)) for o in outputs])
        except BaseException as exc:  # the loop is dead: every waiter must hear of it
            log.exception("engine loop failed")
            self.error = exc
        finally:
            self._fail_all()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        accepted: list = []
        while cmd is not None:
            if isinstance(cmd, _Add):
                self._add(cmd, accepted)
            elif isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_id)
                self._streams.pop(cmd.request_id, None)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                cmd = None
        self._publish_stats()
        for fut, exc in accepted:
            fut.get_loop().call_soon_threadsafe(_settle, fut, exc)

    def _add(self, cmd: _Add, accepted: list) -> None:
        with self._lock:
            self._pending_requests -= 1
            self._pending_tokens -= cmd.tokens
        try:
            self.engine.add_request(
                cmd.request_id, cmd.prompt, cmd.params, priority=cmd.priority, **cmd.options
            )
        except Exception as exc:  # a rejected request: tell its caller, keep serving
            accepted.append((cmd.stream.accepted, exc))
            return
        self._streams[cmd.request_id] = (cmd.stream.accepted.get_loop(), cmd.stream.queue)
        accepted.append((cmd.stream.accepted, None))

    def _log_kv_events(self) -> None:
        events = self.engine.take_kv_events()
        if not events:
            return
        with self._lock:
            for ev in events:
                self._kv_seq += 1
                self._kv_log.append((self._kv_seq, ev))

    def kv_events(self, after: int, limit: int = 20_000) -> dict:
        """Events with sequence numbers above `after`; `reset` when some were already dropped."""
        with self._lock:
            oldest = self._kv_log[0][0] if self._kv_log else self._kv_seq + 1
            reset = after < oldest - 1
            skip = min(max(0, after + 1 - oldest), len(self._kv_log))
            picked = list(itertools.islice(self._kv_log, skip, skip + limit))
            last = picked[-1][0] if picked else max(after, self._kv_seq)
        return {
            "instance": self.instance_id,
            "block_size": self.engine.kv.block_size,
            "reset": reset,
            "next": last,
            "events": [
                {"kind": ev.kind, "block_hash": ev.block_hash, "parent_hash": ev.parent_hash}
                for _, ev in picked
            ],
        }

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        waiting_tokens = sum(r.num_tokens for r in self.engine.scheduler.waiting)
        with self._lock:
            self._stats = stats
            self._waiting_requests = stats.num_waiting
            self._waiting_tokens = waiting_tokens

    def _deliver(self, items: list[tuple[str, RequestOutput]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, out in items:
            target = self._streams.get(rid)
            if target is None:
                continue
            if out.finished:
                del self._streams[rid]
            by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self) -> None:
        streams, self._streams = self._streams, {}
        for loop, stream in streams.values():
            loop.call_soon_threadsafe(stream.put_nowait, _FINISHED)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                fut = cmd.stream.accepted
                fut.get_loop().call_soon_threadsafe(
                    _settle, fut, EngineDeadError("the engine loop has stopped")
                )


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream, out in batch:
        stream.put_nowait(out)
