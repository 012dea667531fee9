"""The batch lane: batches validated at creation, then run line by line on the fleet's spare
capacity, durably (see store.py), until done, expired or cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from shoal.fleet.admission.store import shown
from shoal.fleet.admission.tenants import Tenant
from shoal.fleet.batch.store import BatchStore, Line, line_models, result_line
from shoal.fleet.batch.store_calls import StoreCalls, StoreUnavailable
from shoal.fleet.config import GatewayConfig
from shoal.fleet.proxy.forward import usage_of
from shoal.protocol.bodies import parse_json_object
from shoal.protocol.errors import APIError, error_body

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_LINES = 50_000
MAX_ERRORS = 100  # validation errors reported per batch
MAX_WINDOW_S = 30 * 24 * 3600
MAX_ATTEMPTS = 5  # a line answered with a transient error (429, 5xx) is tried this often
BACKOFF_MAX_S = 30.0
STARTS_PER_TICK = 1
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
NO_RETRY_CODES = frozenset({"poison_request"})  # it took a replica down: running it again would too
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smh])$")


def parse_window(text) -> float:
    """Seconds in a completion window: OpenAI's "24h", or any `<n>s|m|h` up to 30 days."""
    m = _WINDOW.match(text) if isinstance(text, str) else None
    seconds = int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)] if m else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise APIError(
            400, "completion_window must be like 24h, 30m or 90s (at most 720h)", "completion_window"
        )
    return float(seconds)


def check_metadata(metadata) -> dict | None:
    """OpenAI's rule: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(isinstance(k, str) and len(k) <= 64 for k in metadata)
        or not all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())
    ):
        raise APIError(400, "metadata: up to 16 string pairs (keys <= 64, values <= 512 chars)", "metadata")
    return metadata


def validate_input(content: bytes, endpoint: str) -> tuple[list[tuple[str, str | None, str]], list[dict]]:
    """The file's requests as (custom_id, model, body JSON), or the errors that fail the batch
    (each naming its 1-based line). Blank lines are skipped; streaming is turned off."""
    lines: list[tuple[str, str | None, str]] = []
    errors: list[dict] = []
    seen: set[str] = set()
    count = 0

    def bad(n: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": f"line {n}: {message}", "param": param, "line": n})

    for n, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        count += 1
        if count > MAX_LINES:
            bad(n, "too_many_requests", f"a batch holds at most {MAX_LINES} requests")
            break
        try:
            obj = parse_json_object(raw)
        except APIError as exc:
            bad(n, "invalid_json_line", exc.message)
            continue
        cid, body = obj.get("custom_id"), obj.get("body")
        if not isinstance(cid, str) or not cid:
            bad(n, "missing_required_parameter", "custom_id must be a non-empty string", "custom_id")
        elif cid in seen:
            bad(n, "duplicate_custom_id", f"custom_id {cid[:100]!r} is used twice", "custom_id")
        elif obj.get("method") != "POST":
            bad(n, "invalid_method", "method must be POST", "method")
        elif obj.get("url") != endpoint:
            bad(n, "mismatched_url", f"url must be the batch's endpoint, {endpoint}", "url")
        elif not isinstance(body, dict):
            bad(n, "invalid_body", "body must be a JSON object", "body")
        else:
            seen.add(cid)
            body["stream"] = False
            body.pop("stream_options", None)
            model = body.get("model") if isinstance(body.get("model"), str) else None
            lines.append((cid, model, json.dumps(body, ensure_ascii=False)))
    if not lines and not errors:
        errors.append(
            {"code": "empty_file", "message": "the input file holds no requests", "param": None, "line": None}
        )
    return lines, errors


def _error_of(status: int, body) -> dict:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return {
            "code": err.get("code") or err.get("type") or "request_failed",
            "message": str(err.get("message")),
        }
    return {"code": "request_failed", "message": f"the request failed with status {status}"}


class BatchCapacity(Protocol):
    """What the batch lane reads of admission (see admission/dispatch.py)."""

    def spare_slots(self, model: str | None) -> int: ...

    def waiting(self, model: str | None) -> int: ...

    def waiting_below(self, model: str | None, priority: int) -> int: ...

    def may_start(self, model: str | None) -> bool: ...


# One unstreamed request of the batch lane: (path, body, tenant) -> (status, JSON body), whatever
# happens (see Pipeline.run_internal).
RunRequest = Callable[[str, dict, Tenant], Awaitable[tuple[int, dict]]]


class BatchService:
    """Owns the store and the loop that runs batches; the HTTP routes are in api.py."""

    def __init__(
        self,
        config: GatewayConfig,
        capacity: BatchCapacity,
        tenants: Mapping[str, Tenant],
        run: RunRequest,
        by_model: bool,
        shared_store=None,
    ):
        """`shared_store`: the store several gateways share (redis_store.py); default, SQLite in
        the gateway's state directory."""
        self.config = config
        self.capacity = capacity
        self.tenants = tenants  # name -> tenant: a line runs as the tenant that created its batch
        self.run = run
        self.by_model = by_model  # lines take turns by the model they name (a fleet of several)
        self.shared_store = shared_store
        self.store: BatchStore | None = None
        self.db = StoreCalls(shown(config.store) if shared_store is not None else "batches.sqlite3")
        self._loop: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._inflight: dict[str | None, int] = {}  # by capacity key (model, or None)
        self._failures: dict[str | None, int] = {}  # transient failures in a row, by key
        self._retry_at: dict[str | None, float] = {}
        self._active: dict[str, list[str | None]] = {}  # batch id -> the models it names
        self._created: dict[str, list[str | None]] = {}  # batches created while a sweep ran
        # Lines run whose outcome the store did not take (it was away): written when it answers.
        self._unsaved: list[Callable[[], object]] = []
        self._wake = asyncio.Event()

    async def start(self, lead: bool = True) -> None:
        """Opens the store; runs the batches too when `lead` (else the fleet's leader does)."""
        if self.shared_store is not None:
            self.store = self.shared_store
        else:
            path = os.path.join(self.config.state_dir, "batches.sqlite3")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.store = await asyncio.to_thread(BatchStore, path)
        if lead:
            await self.lead()

    async def lead(self) -> None:
        """Runs the batches from now (see _resume)."""
        self._loop = asyncio.get_running_loop().create_task(self._run())

    async def _resume(self) -> None:
        """The lines a stopped (or dead) runner left running run again; those that finished there
        meanwhile keep their one result (see the store's finish)."""
        resumed = await self.db(self.store.recover)
        self._active = await self.db(self.store.active)
        if self._active:
            log.warning("batch lane: resuming %d batches, %d lines run again", len(self._active), resumed)

    async def follow(self) -> None:
        """Stops running the batches (another gateway's runner does)."""
        tasks = [t for t in (self._loop, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._loop, self._active = None, {}
        self._inflight.clear()
        self._unsaved.clear()  # the next leader runs those lines again

    async def stop(self) -> None:
        running = self._loop is not None
        await self.follow()
        if self.store is not None:
            if running:
                with contextlib.suppress(StoreUnavailable):  # then the next leader recovers them
                    await self.db(self.store.recover)  # what was cut short runs at the next start
            await asyncio.to_thread(self.store.close)
            self.store = None
        self.db.close()

    # --- the API's side ------------------------------------------------------------------

    async def create(self, tenant: str, input_file_id, endpoint, window, metadata) -> dict:
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if not isinstance(input_file_id, str):
            raise APIError(400, "input_file_id must be a file id", "input_file_id")
        window_s = parse_window(window)
        metadata = check_metadata(metadata)
        f = await self.db(self.store.get_file, tenant, input_file_id)
        if f is None:
            raise APIError(404, f"no such file: {input_file_id[:100]}", "input_file_id", "file_not_found")
        if f["purpose"] != "batch":
            raise APIError(400, "the input file's purpose must be batch", "input_file_id")
        content = await self.db(self.store.file_content, tenant, input_file_id)
        lines, errors = await asyncio.to_thread(validate_input, content or b"", endpoint)
        batch = await self.db(
            self.store.add_batch, tenant, endpoint, input_file_id, window, window_s, metadata, lines, errors
        )
        if batch["status"] == "in_progress":
            models = line_models(lines)
            self._active[batch["id"]] = self._created[batch["id"]] = models
            self._wake.set()
        return batch

    async def cancel(self, tenant: str, batch_id: str) -> dict | None:
        batch = await self.db(self.store.cancel, tenant, batch_id)
        self._wake.set()
        return batch

    # --- the loop ------------------------------------------------------------------------

    async def _run(self) -> None:
        interval = self.config.batch_poll_interval_s
        resumed = False
        while True:
            self._wake.clear()
            try:
                if not resumed:
                    await self._resume()
                    resumed = True
                await self._tick()
            except StoreUnavailable:  # logged once by the store's calls: try again in a while
                await asyncio.sleep(1.0)
            except Exception:  # a bug: log it, try again later, do not stop the lane
                log.exception("batch lane tick failed")
                await asyncio.sleep(1.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)

    async def _tick(self) -> None:
        while self._unsaved:
            await self.db(self._unsaved[0])
            self._unsaved.pop(0)
        if not self._active and self.shared_store is None:  # a shared one's come from any gateway
            return
        self._created = {}
        swept = await self.db(self.store.sweep, None)
        self._active = {**swept, **self._created}  # one created during the sweep is not in it
        budget = self.config.batch_max_inflight - len(self._tasks)
        by_model = self.by_model
        keys = dict.fromkeys(m for ms in self._active.values() for m in ms) if by_model else {None: None}
        for key in keys:
            # One start per model per tick (a tick also follows each finished line): the batch's
            # prefills are staggered, so an interactive arrival shares its step with at most one.
            n = min(budget, self.allowed(key) - self._inflight.get(key, 0), STARTS_PER_TICK)
            if n <= 0 or time.monotonic() < self._retry_at.get(key, 0.0):
                continue
            for line in await self.db(self.store.claim, n, key, by_model):
                budget -= 1
                self._inflight[key] = self._inflight.get(key, 0) + 1
                task = asyncio.get_running_loop().create_task(self._run_line(line, key))
                self._tasks.add(task)

    def allowed(self, key: str | None) -> int:
        """Batch requests of `key` allowed in flight now.

        Interactive traffic goes first: none while an interactive request waits at the gateway, and
        at most half (rounded up) of the slots interactive traffic leaves free, so that the batch
        shrinks as interactive demand grows and some room is always left for the next arrival;
        never more than batch_max_inflight. The engine also runs batch requests at the lowest
        priority, so an interactive arrival overtakes them there too.

        A model with no replica to measure (one scaled to zero, or an id the fleet routes some
        other way) gets one request at a time when nothing waits: it wakes the model, or fails.
        """
        cfg, capacity = self.config, self.capacity
        if capacity.waiting_below(key, cfg.batch_priority) > 0:
            return 0
        mine = self._inflight.get(key, 0)
        free = capacity.spare_slots(key) + mine  # the slots batch requests now hold count as free
        if free > 0:
            return min(cfg.batch_max_inflight, (free + 1) // 2)
        if mine or capacity.waiting(key):
            return 0
        return 1 if capacity.may_start(key) else 0

    async def _run_line(self, line: Line, key: str | None) -> None:
        try:
            outcome = self._outcome(line, key, *await self._send(line))
            try:
                await self.db(outcome)
            except StoreUnavailable:
                self._unsaved.append(outcome)
        except Exception:  # a bug: the line stays running and runs again after a restart
            log.exception("batch %s line %d", line.batch_id, line.line_no)
        finally:
            self._inflight[key] -= 1
            self._tasks.discard(asyncio.current_task())
            self._wake.set()

    def _outcome(self, line: Line, key: str | None, status: int, body: dict) -> Callable[[], object]:
        """What the store is to keep of a line answered `status`, `body`: its result, or (for a
        transient failure: no replica, overloaded, a replica died) the line to run again, after a
        pause of its model's lines, longer each time in a row."""
        code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
        if status in RETRY_STATUSES and code not in NO_RETRY_CODES and line.attempts < MAX_ATTEMPTS:
            fails = self._failures[key] = self._failures.get(key, 0) + 1
            self._retry_at[key] = time.monotonic() + min(BACKOFF_MAX_S, 0.5 * 2**fails)
            return functools.partial(self.store.requeue, line)
        self._failures.pop(key, None)
        self._retry_at.pop(key, None)
        if status == 200:
            result = result_line(line.custom_id, status, body)
        else:
            result = result_line(line.custom_id, status, body, _error_of(status, body))
        return functools.partial(self.store.finish, line, status == 200, result, usage_of(body))

    async def _send(self, line: Line) -> tuple[int, dict]:
        tenant = self.tenants.get(line.tenant)
        if tenant is None:
            return 403, error_body(
                403, f"the batch's tenant {line.tenant} is no longer configured", code="tenant_gone"
            )
        try:
            return await self.run(line.endpoint, json.loads(line.body), tenant)
        except Exception as exc:  # run_internal answers request errors; anything else is a bug
            log.exception("batch request failed")
            return 500, error_body(500, f"internal error: {type(exc).__name__}")
