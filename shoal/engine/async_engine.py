"""The async front of the engine: the step loop runs on its own thread, callers await per-request
streams on their event loop.

Commands (add, abort, stop) cross into the engine thread through a queue and are applied between
steps, so an abort takes effect before the next step. What crosses back is token deltas, once per
step with one `call_soon_threadsafe`; each stream turns them into text on its own event loop (the
engine thread never detokenizes), and a consumer that lags finds its deltas merged into one
output, not a queue of snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.engine.core import EngineCore
from shoal.engine.kv_event_log import KVEventLog
from shoal.engine.output_processor import OutputProcessor
from shoal.engine.outputs import EngineCoreOutput, RequestOutput
from shoal.engine.parallel.executor import ExecutorDeadError
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.step_result import EngineStats, StepResult
from shoal.protocol.bounds import check_bounds

log = logging.getLogger(__name__)


class EngineOverloadedError(Exception):
    """The waiting queue is full; retry later."""


class EngineDeadError(Exception):
    """The engine loop has stopped; nothing more will be served. `rank_lost`: because a rank of a
    parallel model died or hung, not because of anything a request did."""

    def __init__(self, message: str, rank_lost: bool = False):
        super().__init__(message)
        self.rank_lost = rank_lost


@dataclass
class AsyncEngineConfig:
    # Bounds on work admitted but not yet scheduled; past them new requests are refused (503).
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 262_144
    # A step longer than this, with work pending, marks the engine unhealthy.
    stall_timeout_s: float = 60.0
    # KV events kept for routers that poll; one that falls further behind is told to resync.
    kv_event_log_size: int = 200_000
    # K/V held for another engine (disaggregation) is freed if nobody takes it within this.
    kv_hold_timeout_s: float = 30.0

    def __post_init__(self):
        # 0 waiting: every request is refused (a replica that sheds all it is sent)
        least = {"max_waiting_requests": 0, "max_waiting_tokens": 0, "kv_event_log_size": 1}
        check_bounds(self, least, above={"stall_timeout_s": 0, "kv_hold_timeout_s": 0})


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    tokens: int
    stream: RequestStream
    options: dict


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Runs fn() on the engine thread and settles `future` with what it returns or raises."""

    fn: Callable[[], Any]
    future: asyncio.Future


@dataclass
class _Stop:
    request_id: str  # the choice's engine request
    stop: str


class RequestStream:
    """One request's outputs, in order; the last has `finished` set. Closing it early aborts it."""

    def __init__(self, engine: AsyncEngine, request_id: str, accepted: asyncio.Future, processor):
        self.engine = engine
        self.request_id = request_id
        self.accepted = accepted
        self.processor: OutputProcessor = processor
        self.pending: list[EngineCoreOutput] = []
        self.wakeup = asyncio.Event()
        self.dead = False
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            if not self.pending:
                if self.dead:
                    self.finished = True
                    error = self.engine.error
                    raise EngineDeadError(
                        f"the engine loop stopped while the request ran: {error}",
                        rank_lost=isinstance(error, ExecutorDeadError),
                    )
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            batch, self.pending = self.pending, []
            outputs, stops = self.processor.process(batch, now=time.monotonic())
            for request_id, stop in stops:
                self.engine.stop(request_id, stop)
            if outputs:
                self.finished = outputs[0].finished
                return _snapshot(outputs[0])
        raise StopAsyncIteration

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    def _push(self, batch: list[EngineCoreOutput]) -> None:
        self.pending.extend(batch)
        self.wakeup.set()

    def _die(self) -> None:
        self.dead = True
        self.wakeup.set()


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the stream's processor will not change. The cumulative token and logprob lists,
    which it keeps growing, are left out: consumers build them from the deltas."""
    outputs = [dataclasses.replace(o, token_ids=[], logprobs=None) for o in out.outputs]
    return dataclasses.replace(out, outputs=outputs, metrics=dict(out.metrics))


class AsyncEngine:
    """Drives an EngineCore on its own thread; talks to it only through the core's narrow
    interface (add, abort, stop, step results, stats, K/V handoff calls)."""

    def __init__(self, engine: EngineCore, config: AsyncEngineConfig | None = None):
        self.engine = engine
        self.config = config or AsyncEngineConfig()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._lock = threading.Lock()  # guards the admission counters and the stats snapshot
        self._pending_requests = 0  # submitted, not yet seen by the engine thread
        self._pending_tokens = 0
        self._waiting_requests = 0
        self._waiting_tokens = 0
        self._stats = engine.stats()
        self._step_started: float | None = None
        self._last_step_end = time.monotonic()
        self._stop = threading.Event()
        self.kv_log = KVEventLog(self.config.kv_event_log_size, engine.block_size)
        # Handoffs packed on the engine thread as their prefill finished; read here by the front
        # (a dict's get and pop are atomic), so a pull never waits behind the next steps.
        self._handoffs: dict[str, Any] = {}
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
        `options` go to EngineCore.add_request (a resumed request's prior output, K/V handoff);
        `prior_text_sent` stays here, with the stream's text.

        Raises the engine's RequestRejectedError for a bad request, EngineOverloadedError when the
        waiting queue is full, EngineDeadError when the loop has stopped.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped")
        loop = asyncio.get_running_loop()
        text = prompt if isinstance(prompt, str) else None
        if text is not None:  # off the event loop, and off the engine thread
            prompt = await loop.run_in_executor(None, self.engine.tokenizer.encode, text)
        tokens = len(prompt)
        self._admit(tokens)
        processor = OutputProcessor(self.engine.tokenizer)
        processor.add(
            request_id,
            text,
            list(prompt),
            params,
            options.get("prior_output_ids"),
            options.get("prior_text_sent"),
        )
        stream = RequestStream(self, request_id, loop.create_future(), processor)
        options.pop("prior_text_sent", None)
        self._commands.put(_Add(request_id, list(prompt), params, priority, tokens, stream, options))
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

    async def export_kv(self, request_id: str):
        """The K/V a finished request held (`hold_kv`), packed when its prefill finished. (A
        prefill step of other prompts can take a second: a pull that waited for the engine
        thread waited for it.)"""
        packed = self._handoffs.get(request_id)
        if packed is not None:
            return packed
        return await self._call(lambda: self.engine.export_kv(request_id))

    async def export_prefix(self, hashes: list[int]):
        """The K/V this engine holds of a prompt's leading blocks (engine.core), on its thread."""
        return await self._call(lambda: self.engine.export_prefix(hashes))

    def prompt_hashes(self, ids: list[int], lora: str | None = None) -> list[int]:
        return self.engine.prompt_hashes(ids, lora)

    async def release_kv(self, request_id: str) -> bool:
        self._handoffs.pop(request_id, None)
        return await self._call(lambda: self.engine.release_kv(request_id))

    async def add_lora(self, name: str, path: str) -> None:
        """Reads an adapter off the engine's thread (disk, checks), then registers it between
        two steps: requests already running do not wait for the read."""
        adapters = self.engine.adapters()
        adapter = await asyncio.get_running_loop().run_in_executor(None, adapters.read, name, path)
        await self._call(lambda: adapters.register(adapter))

    async def remove_lora(self, name: str) -> None:
        await self._call(lambda: self.engine.adapters().unregister(name))

    async def _call(self, fn):
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped")
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, future))
        return await future

    def stop(self, request_id: str, stop: str) -> None:
        """Finishes one choice whose text reached a stop string (found by its stream)."""
        self._commands.put(_Stop(request_id, stop))

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
            "num_steps": s.num_steps,
            "kv_held": s.num_kv_held,
            "max_num_seqs": self.engine.config.scheduler.max_num_seqs,
        }

    # --- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_unfinished_requests()
                self._drain(block=idle)
                if idle:
                    self.engine.check_health()  # a rank of a parallel engine may die between steps
                if expired := self.engine.expire_held_kv(self.config.kv_hold_timeout_s):
                    for rid in expired:
                        self._handoffs.pop(rid, None)
                    # The freed blocks show in /load and /metrics now.
                    self._publish_stats(self.engine.stats())
                if self._stop.is_set() or not self.engine.has_unfinished_requests():
                    continue
                self._step_started = time.monotonic()
                result = self.engine.step()
                self._last_step_end = time.monotonic()
                self._step_started = None
                self._publish_stats(result.stats)
                self.kv_log.extend(result.kv_events)
                self._handoffs.update(self.engine.pack_new_handoffs())  # before the front hears
                self._deliver(result)
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
            elif isinstance(cmd, _Call):
                try:
                    result, error = cmd.fn(), None
                except Exception as exc:
                    result, error = None, exc
                cmd.future.get_loop().call_soon_threadsafe(_resolve, cmd.future, result, error)
            elif isinstance(cmd, _Stop):
                finished = self.engine.stop_request(cmd.request_id, cmd.stop)
                if finished is not None:
                    self._streams.pop(finished, None)  # no step will report it again
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                cmd = None
        self._publish_stats(self.engine.stats())
        self.kv_log.extend(self.engine.take_kv_events())  # an abort's freed blocks
        for fut, exc in accepted:
            fut.get_loop().call_soon_threadsafe(_settle, fut, exc)

    def _add(self, cmd: _Add, accepted: list) -> None:
        with self._lock:
            self._pending_requests -= 1
            self._pending_tokens -= cmd.tokens
        try:
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt_ids,
                cmd.params,
                priority=cmd.priority,
                **cmd.options,
            )
        except Exception as exc:  # a rejected request: tell its caller, keep serving
            accepted.append((cmd.stream.accepted, exc))
            return
        self._streams[cmd.request_id] = (cmd.stream.accepted.get_loop(), cmd.stream)
        accepted.append((cmd.stream.accepted, None))

    @property
    def instance_id(self) -> str:
        return self.kv_log.instance_id

    def kv_events(self, after: int, limit: int = 20_000) -> dict:
        """KV events with sequence numbers above `after` (see engine.kv_event_log)."""
        return self.kv_log.since(after, limit)

    def _publish_stats(self, stats: EngineStats) -> None:
        with self._lock:
            self._stats = stats
            self._waiting_requests = stats.num_waiting
            self._waiting_tokens = stats.num_waiting_tokens

    def _deliver(self, result: StepResult) -> None:
        by_stream: dict[str, list[EngineCoreOutput]] = {}
        for co in result.outputs:
            by_stream.setdefault(co.group_id, []).append(co)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for gid, batch in by_stream.items():
            target = self._streams.get(gid)
            if target is None:
                continue
            if gid in result.finished_groups:  # every choice of it has finished
                del self._streams[gid]
            by_loop.setdefault(target[0], []).append((target[1], batch))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_push_all, items)

    def _fail_all(self) -> None:
        streams, self._streams = self._streams, {}
        for loop, stream in streams.values():
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody is waiting
                loop.call_soon_threadsafe(stream._die)
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


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(result)
    else:
        fut.set_exception(exc)


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    _resolve(fut, None, exc)


def _push_all(items: list[tuple[RequestStream, list[EngineCoreOutput]]]) -> None:
    for stream, batch in items:
        stream._push(batch)
