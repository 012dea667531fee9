"""A streamed request: opened before the first byte (with retries), relayed, and continued on
other replicas when its replica dies, one resume request per unfinished choice, merged back into
the client's one stream. A stream asked to move (fleet/replicas/table.py move_streams) has its
context copied to another replica while it runs (migration.py), then goes on there. A
non-streamed completion goes the same way, folded back into one answer (fold.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from fastapi.responses import JSONResponse, Response

from shoal.fleet.admission.dispatch import NoReplicaError, ReplicaLease
from shoal.fleet.proxy.disagg import peer_params
from shoal.fleet.proxy.fold import StreamFold, streamed
from shoal.fleet.proxy.forward import Forward, json_or_none, passthrough, unavailable
from shoal.fleet.proxy.migration import copy_to_another
from shoal.fleet.proxy.parts import RelayParts
from shoal.fleet.proxy.stream_parts import (
    RelayResponse,
    StopRelay,
    Upstream,
    keep,
    prompt_ids_from_a_replica,
    response_headers,
    with_usage,
)
from shoal.fleet.proxy.stream_state import ORIGINAL, StreamState, Tag
from shoal.fleet.proxy.upstream import Attempt, Outcome, error_outcome, sse_events
from shoal.fleet.routing.policies import RouteRequest
from shoal.protocol import tracing
from shoal.protocol.errors import APIError
from shoal.protocol.sse import SSE_DONE, sse

log = logging.getLogger(__name__)


class StreamRelay:
    def __init__(self, parts: RelayParts, fwd: Forward, folded: bool = False):
        """`folded`: a non-streamed request, relayed as a stream and answered once (fold.py)."""
        self.p = parts
        self.fwd = fwd
        self.cfg = parts.config
        self.dispatch = parts.dispatch
        self.metrics = parts.metrics
        self.folded = folded
        self.state = StreamState(fwd.path, streamed(fwd.body) if folded else fwd.body)
        self.failed: set[str] = set()  # replicas that failed this request: not tried again
        self.seen: dict = {}  # deaths already judged for this request
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=64)
        self.pumps: dict[Upstream, asyncio.Task] = {}
        self.upstreams: list[Upstream] = []
        self.answered_by: list[str] = []  # the replicas whose tokens the answer holds, in order
        self.ids_complete = True  # every upstream so far gave token ids
        self.first_event = True
        self.cleaned = False
        self.last_token_at: float | None = None
        self.migrated_at: float | None = None  # the last token before a move, until the next one
        self.moving: asyncio.Task | None = None  # a move under way: its copy phase
        self.move_to: str | None = None  # the replica a move's copy went to
        self.copied: dict[int, int] = {}  # choice -> its context's length when it was copied

    # --- opening -------------------------------------------------------------------------

    async def start(self) -> Response:
        up = await self._open_original()
        if not isinstance(up, Upstream):
            self.metrics.e2e.observe(time.monotonic() - self.fwd.started)
            return up
        self.launch(up)
        headers = response_headers(up)
        return RelayResponse(self.cleanup, self.run(), media_type="text/event-stream", headers=headers)

    async def answer(self) -> Response:
        """The folded relay's one answer, once its stream has ended."""
        fold = StreamFold(self.fwd.path, self.fwd.body)
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                up = await self._open_original()
                if not isinstance(up, Upstream):
                    return up
                self.launch(up)
                async for obj in self.events():
                    fold.add(obj)
        except StopRelay as stop:
            return APIError(stop.status, stop.message, code=stop.code).response()
        except TimeoutError:
            message = f"the request did not finish within {self.cfg.request_timeout_s:.0f} s"
            return APIError(504, message, code="timeout").response()
        except APIError as err:  # a remote prefill's poison verdict
            return err.response()
        except Exception:
            return self._own_failure().response()
        finally:
            self.cleanup()
        headers = response_headers(up)
        if self.answered_by:  # a stream sends its headers first; one answer can name every replica
            headers["x-replica"] = ", ".join(self.answered_by)
        return JSONResponse(fold.answer(self.state.prompt_ids_for), headers=headers)

    async def _open_original(self) -> Upstream | Response:
        try:
            return await self.open(ORIGINAL, self.fwd.route, with_usage(self.state.body), budget=True)
        except StopRelay as stop:
            return APIError(stop.status, stop.message, code=stop.code).response()

    async def open(
        self,
        tag: Tag,
        route: RouteRequest,
        body: dict,
        budget: bool,
        headers: dict | None = None,
        prefer: str | None = None,
    ) -> Upstream | Response:
        """A replica's stream for `body`, trying others while it provably did not run there (or
        the replica said so). `budget`: retries draw on the retry budget (before the first byte).
        `prefer`: the replica to try first, if it takes the request now."""
        last: Response | None = None
        for attempt_no in range(self.cfg.max_retries + 1):
            try:
                lease = await self._lease(route, prefer if attempt_no == 0 else None)
            except NoReplicaError as exc:
                if last is None:
                    self.metrics.rejections.inc()
                    last = unavailable(str(exc))
                break
            with lease.held_until_given_back():
                tried = await self._try(tag, lease, body, headers, budget, attempt_no < self.cfg.max_retries)
            if not isinstance(tried, tuple):
                return tried
            again, last = tried
            if not again:
                break
        return last or unavailable("no replica could serve the request")

    async def _try(
        self, tag: Tag, lease: ReplicaLease, body: dict, headers: dict | None, budget: bool, may_retry: bool
    ) -> Upstream | Response | tuple[bool, Response]:
        """One replica's try: its stream (the lease goes with it), the client's answer, or (whether
        to try another, the answer so far)."""
        cfg, p, replica = self.cfg, self.p, lease.replica
        # A shoal replica can return token ids: its output can be continued exactly.
        with_ids = bool(body.get("return_token_ids")) or replica.kv_events
        out = {**body, "return_token_ids": True} if with_ids else body
        sent_headers = headers or self.fwd.headers
        if tag is ORIGINAL:
            out, sent_headers = await p.prefill.with_prefill(self.fwd, replica, out, sent_headers, self.seen)
        content = await p.client.encode(out, self.fwd.size)
        attempt = Attempt(replica, self.fwd.route.priority)
        try:
            async with attempt.deadline(cfg.first_byte_timeout_s):
                resp = await p.client.send(replica, self.fwd.path, content, sent_headers)
                if resp.status_code != 200:
                    try:
                        data = await resp.aread()
                    finally:
                        await resp.aclose()
        except (httpx.HTTPError, TimeoutError) as exc:
            outcome = attempt.outcome(exc)
            timeout = outcome.kind == "timeout"  # aborted by closing it: it runs nowhere now
            lease.give_back(None if timeout else False, outcome.message, failed=True)
            self.failed.add(replica.name)
            last = unavailable(f"replica {replica.name} failed: {outcome.message}")
            if outcome.is_death:
                # Sent but no answer: it may have run, and its replica may have died of it.
                try:
                    verdict = await p.judge.judge_death(self.fwd, attempt, outcome, self.seen)
                finally:
                    attempt.done()
                if verdict == "poison":
                    raise StopRelay(
                        500, f"this request took replica {replica.name} down", "poison_request"
                    ) from None
                if may_retry:
                    self.metrics.retries.labels(outcome.kind).inc()
                return may_retry, last
            attempt.done()
            reason = "connect" if outcome.kind == "not_sent" else outcome.kind
            return may_retry and (not budget or p.retries.may_retry(reason)), last
        except BaseException:
            attempt.done()  # cut short (its client left): the lease is given back above us
            raise
        if resp.status_code != 200:
            attempt.done()
            return self._refused(lease, resp, data, budget, may_retry)
        self.ids_complete &= with_ids
        # It can move (fleet/replicas/table.py move_streams): its tokens are known exactly.
        attempt.movable = self.ids_complete and bool(self.cfg.kv_transfer_key)
        up = Upstream(attempt, resp, tag, with_ids, lease)
        attempt.on_move = lambda up=up: self.request_move(up)
        self.upstreams.append(up)
        return up

    def _refused(
        self, lease: ReplicaLease, resp: httpx.Response, data: bytes, budget: bool, may_retry: bool
    ) -> Response | tuple[bool, Response]:
        """A replica's answer other than 200, before its stream began."""
        replica = lease.replica
        if resp.status_code < 500:  # the client's doing (or a resume the replica refused)
            lease.give_back(True)
            out_resp = passthrough(resp, data)
            out_resp.headers["x-replica"] = replica.name
            return out_resp
        if error_outcome(json_or_none(data)).kind == "draining":  # not a failure
            lease.give_back(True)
            self.p.table.saw_draining(replica.name)
            if may_retry:
                self.metrics.retries.labels("draining").inc()
            return may_retry, passthrough(resp, data)
        # Refused before the stream began, so it did not run: any 5xx may go elsewhere.
        lease.give_back(resp.status_code == 503, f"HTTP {resp.status_code}", failed=True)
        self.failed.add(replica.name)
        reason = f"http_{resp.status_code}"
        return may_retry and (not budget or self.p.retries.may_retry(reason)), passthrough(resp, data)

    async def _lease(self, route: RouteRequest, prefer: str | None) -> ReplicaLease:
        if prefer is not None:
            others = set(self.p.table.replicas) - {prefer}
            try:
                return await self.dispatch.lease(route, others | self.failed, timeout=0)
            except NoReplicaError:
                pass  # it does not take requests now: wherever the policy says
        return await self.dispatch.lease(route, self.failed)

    # --- relaying ------------------------------------------------------------------------

    def launch(self, up: Upstream) -> None:
        self.pumps[up] = asyncio.create_task(self._pump(up))

    async def _pump(self, up: Upstream) -> None:
        cfg = self.cfg
        try:
            async for obj in sse_events(
                up.resp, up.attempt, cfg.first_byte_timeout_s, cfg.stream_idle_timeout_s
            ):
                await self.queue.put((up, obj, None))
            outcome = None
        except Exception as exc:  # every failure is reported, as an outcome
            outcome = up.attempt.outcome(exc)
        finally:
            await up.resp.aclose()
        await self.queue.put((up, None, outcome))

    def finish(self, up: Upstream, ok: bool | None, reason: str = "", failed: bool = False) -> None:
        up.lease.give_back(ok, reason, failed)

    async def run(self):
        """The client's stream."""
        try:
            async for obj in self.events():
                yield sse(obj)
        except StopRelay as stop:
            yield stop.event
        except APIError as err:
            yield sse(err.body())
        except Exception:  # the client is told, not cut off mid-stream
            yield sse(self._own_failure().body())
        yield SSE_DONE

    def _own_failure(self) -> APIError:
        """The gateway's own error while relaying (logged with its traceback): the answer ends with
        a 500, and every replica it held is given back by the cleanup."""
        log.exception("request %s: the relay failed", self.fwd.headers.get("x-request-id"))
        return APIError(500, "the gateway failed while relaying the answer", code="gateway_error")

    async def events(self):
        """What the client is sent, as objects, until the stream ends or a StopRelay ends it."""
        state = self.state
        try:
            while self.pumps:
                up, obj, outcome = await self.queue.get()
                if obj is not None:
                    out, tokens = state.relay(up.tag, obj)
                    if tokens:
                        if up.replica.name not in self.answered_by:
                            self.answered_by.append(up.replica.name)
                        now = time.monotonic()
                        up.attempt.took_tokens(tokens, now, up.tag is ORIGINAL)
                        if self.last_token_at is not None and not self.folded:
                            self.metrics.itl.observe((now - self.last_token_at) / tokens)
                        self.last_token_at = now
                        if self.migrated_at is not None:
                            self.metrics.migration_pause.observe(now - self.migrated_at)
                            self.migrated_at = None
                    if out is not None:
                        if self.first_event and not self.folded:  # a folded answer's client sees none
                            self.first_event = False
                            ttft = time.monotonic() - self.fwd.started
                            self.metrics.ttft.observe(ttft)
                            self.p.demand.observe_ttft(self.fwd.route.model, ttft)
                        yield out
                    continue
                self.pumps.pop(up, None)
                if outcome is None:
                    self.finish(up, True)
                    up.attempt.done()
                    continue
                await self.recover(up, outcome)
            usage = state.final_usage()
            if usage is not None:
                yield usage
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """Once, when the stream ends or is dropped (also one never sent: its generator's own
        `finally` would not run). Without awaiting: a client that went away cancels the generator,
        and anyio would cancel every await here again. The pumps close their own responses."""
        if self.cleaned:
            return
        self.cleaned = True
        for up in self.upstreams:
            up.lease.abandon()  # still running there: the stream ended without its outcome
            up.attempt.done()
            if up not in self.pumps:
                keep(asyncio.get_running_loop().create_task(up.resp.aclose()))
        for t in [*self.pumps.values(), *([self.moving] if self.moving else [])]:
            t.cancel()
            keep(t)
        self.metrics.e2e.observe(time.monotonic() - self.fwd.started)
        self.fwd.usage = self.state.token_counts()
        if self.state.saw_token_ids and self.ids_complete:
            self.fwd.output_ids = [c.ids for _, c in sorted(self.state.choices.items())]
        self.fwd.settle()

    # --- failover ------------------------------------------------------------------------

    async def recover(self, up: Upstream, outcome: Outcome) -> None:
        """After `up` failed: continue its unfinished choices elsewhere, or raise StopRelay."""
        what = {"shoal.replica": up.replica.name, "shoal.reason": outcome.kind}
        name = "gateway.migration" if outcome.kind == "migrated" else "gateway.failover"
        with tracing.child(name, self.fwd.route.span, **what):
            if outcome.kind == "migrated":
                return await self.migrate(up)
            return await self._recover(up, outcome)

    async def _recover(self, up: Upstream, outcome: Outcome) -> None:
        state, r = self.state, up.replica
        rid = self.fwd.headers.get("x-request-id")
        log.warning(
            "request %s: stream from %s broke after %d events: %s", rid, r.name, state.events, outcome.message
        )
        self.failed.add(r.name)
        served = state.unfinished if up.tag is ORIGINAL else [up.tag.resume_of]
        if not any(i in state.unfinished for i in served):  # it died after its last token
            self.finish(up, None)
            up.attempt.done()
            return
        if outcome.kind == "internal_error":
            # The engine failed this request alone and went on: it would fail anywhere.
            self.finish(up, True, failed=True)
            await self.p.judge.strike(self.fwd)
            raise StopRelay(500, f"the request failed in the engine: {outcome.message}", "internal_error")
        self.finish(up, None if outcome.kind == "timeout" else False, f"mid-stream: {outcome.message}", True)
        if outcome.is_death:
            verdict = await self.p.judge.judge_death(self.fwd, up.attempt, outcome, self.seen)
            if verdict == "poison":
                raise StopRelay(500, f"this request took replica {r.name} down", "poison_request")
        up.attempt.done()
        if up.tag is ORIGINAL and state.events == 0:
            # Nothing reached the client: the original request, from the start, elsewhere.
            again = await self.open(ORIGINAL, self.fwd.route, with_usage(state.body), budget=False)
            if not isinstance(again, Upstream):
                raise StopRelay(503, "no replica left to serve the stream", "no_replica")
            self.metrics.failovers.inc()
            self.launch(again)
            return
        for i in served:
            if not state.choices[i].finished:
                await self._resume(i)

    def _served(self, up: Upstream) -> list[int]:
        """The unfinished choices `up` streams."""
        state = self.state
        served = state.unfinished if up.tag is ORIGINAL else [up.tag.resume_of]
        return [i for i in served if not state.choices[i].finished]

    def request_move(self, up: Upstream) -> None:
        """Starts moving `up`'s stream to another replica (see migration.py)."""
        if self.moving is None and up in self.pumps and not self.cleaned:
            self.moving = asyncio.create_task(self._copy_then_move(up))
        elif self.moving is None:
            up.attempt.move_asked = False

    async def _copy_then_move(self, up: Upstream) -> None:
        t0 = time.monotonic()
        try:
            outcome = await self._copy(up)
        finally:
            self.moving = None
        if outcome in ("copied", "refused"):
            if up in self.pumps:
                up.attempt.migrate()  # the pump ends with "migrated": see migrate()
                if outcome == "copied":
                    self.metrics.migration_copy.observe(time.monotonic() - t0)
                return
            outcome, self.move_to, self.copied = "ended", None, {}  # it ended (or failed) meanwhile
        self.metrics.migrations.labels(outcome).inc()  # the stream stays where it runs
        up.attempt.move_asked = False  # and may be asked again

    async def _copy(self, up: Upstream) -> str:
        """Copies the contexts of `up`'s choices to the replica they will move to, chosen now."""
        state, source = self.state, up.replica
        served = self._served(up)
        if not served or (up.tag is ORIGINAL and state.events == 0):
            return "refused"  # nothing generated yet to copy: it moves at once
        contexts = []
        for i in served:
            prompt_ids = state.prompt_ids_for(i) or await self._tokenize(i)
            if prompt_ids is None:
                return "refused"
            contexts.append((i, prompt_ids + state.choices[i].ids))
        outcome, target = await copy_to_another(
            self.p, self.fwd, source, [ctx for _, ctx in contexts], self._route(contexts[0][1]), self.failed
        )
        if outcome == "copied":
            self.move_to = target.name
            self.copied = {i: len(ctx) for i, ctx in contexts}
        return outcome

    async def migrate(self, up: Upstream) -> None:
        """`up` was ended to move its stream: each unfinished choice it served goes on elsewhere
        from where it stopped: where its context was copied, or fetching it from `up`'s replica."""
        state, r = self.state, up.replica
        self.finish(up, True)  # not the replica's failure
        up.attempt.done()
        served = self._served(up)
        target, self.move_to = self.move_to, None
        outcome = "ok" if served else "nothing_left"
        # Anywhere but there, this once: should the target fail, the stream may come back.
        self.failed.add(r.name)
        try:
            if served and up.tag is ORIGINAL and state.events == 0:
                # Before its first token: it starts again there (its prompt's computed blocks
                # fetched, when the gateway's index shows them).
                again = await self.open(ORIGINAL, self.fwd.route, with_usage(state.body), budget=False)
                if not isinstance(again, Upstream):
                    raise StopRelay(503, "no replica left to serve the stream", "no_replica")
                self.launch(again)
                served, outcome = [], "restarted"
            for i in served:
                await self._resume(i, moved_from=r, prefer=target)
        finally:
            self.failed.discard(r.name)
            self.copied = {}
        self.metrics.migrations.labels(outcome).inc()
        self.migrated_at = self.last_token_at or time.monotonic()

    def _route(self, context: list[int]) -> RouteRequest:
        """A continuation's route: the request's, keyed by its context so far."""
        r = self.fwd.route
        return RouteRequest(
            self.p.keys.hash_ids(context, r.adapter),
            r.session,
            model=r.model,
            adapter=r.adapter,
            tenant=r.tenant,
            priority=r.priority,
            charged=True,
        )

    async def _resume(self, index: int, moved_from=None, prefer: str | None = None) -> None:
        """Continues choice `index` on another replica (`prefer`, if it takes it). `moved_from`: the
        replica it moved off, which holds its K/V: fetched from there, unless a copy already put
        all but a few tokens of it where it goes."""
        state = self.state
        c = state.choices[index]
        if not self.ids_complete:
            raise StopRelay(502, "the replica failed mid-stream and its output cannot be continued")
        if c.reopened > self.cfg.max_retries:
            raise StopRelay(502, f"the stream failed {c.reopened + 1} times; giving up")
        prompt_ids = state.prompt_ids_for(index) or await self._tokenize(index)
        if prompt_ids is None:
            raise StopRelay(502, "the replica failed mid-stream before its prompt was known")
        context = prompt_ids + c.ids
        copied = self.copied.get(index) if prefer is not None else None
        since_copy = len(context) - (copied or 0)
        body, tag = state.resume_body(index, prompt_ids)
        headers = None
        fetch = since_copy >= self.cfg.peer_fetch_min_tokens
        if moved_from is not None and self.cfg.kv_transfer_key and fetch:
            body["kv_transfer_params"] = peer_params(moved_from)
            headers = self.p.prefill.headers(self.fwd.headers)
        up = await self.open(tag, self._route(context), body, budget=False, headers=headers, prefer=prefer)
        if isinstance(up, Response) and up.status_code < 500:
            raise StopRelay(502, f"the continuation was refused: {up.body.decode(errors='replace')[:300]}")
        if not isinstance(up, Upstream):
            raise StopRelay(503, "no replica left to continue the stream", "no_replica")
        if moved_from is None:
            self.metrics.failovers.inc()
        self.launch(up)

    async def _tokenize(self, index: int) -> list[int] | None:
        """The prompt's ids, for a choice that failed before it said them."""
        text = self.state.prompt_text_for(index)
        return None if text is None else await prompt_ids_from_a_replica(self.p, self.fwd, text, self.failed)
