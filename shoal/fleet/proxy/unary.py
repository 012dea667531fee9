"""A non-streamed request: sent to a replica, and sent again elsewhere where it provably did not
run there, or its replica died under it and the poison rule allows one more run (see poison.py)."""

from __future__ import annotations

import httpx
from fastapi.responses import Response

from shoal.fleet.admission.dispatch import NoReplicaError, ReplicaLease
from shoal.fleet.proxy.forward import Forward, json_or_none, passthrough, unavailable, usage_of
from shoal.fleet.proxy.parts import RelayParts
from shoal.fleet.proxy.poison import poison_error
from shoal.fleet.proxy.upstream import Attempt, error_outcome
from shoal.protocol.errors import APIError


class UnaryRelay:
    def __init__(self, parts: RelayParts):
        self.p = parts

    async def run(self, fwd: Forward) -> Response:
        p = self.p
        cfg = p.config
        tried: set[str] = set()
        seen: dict = {}
        last: Response | None = None
        content_out = await p.client.encode(fwd.body, fwd.size)
        for attempt_no in range(cfg.max_retries + 1):
            can_retry = attempt_no < cfg.max_retries
            try:
                lease = await p.dispatch.lease(fwd.route, tried)
            except NoReplicaError as exc:
                if last is None:
                    p.metrics.rejections.inc()
                    last = unavailable(str(exc))
                break
            replica = lease.replica
            tried.add(replica.name)
            with lease.held_until_given_back():
                body, headers = await p.prefill.with_prefill(fwd, replica, fwd.body, fwd.headers, seen)
                content = content_out if body is fwd.body else await p.client.encode(body, fwd.size)
                attempt = Attempt(replica)
                try:
                    out = await self._try(fwd, attempt, lease, content, headers, seen)
                finally:
                    attempt.done()  # only now: a death judged above must count it among its suspects
            if isinstance(out, Response):
                return out
            retry, last = out
            if not can_retry:
                break
            if retry in ("interrupted", "dropped", "engine_dead", "draining"):
                # Its replica died: running it once more is the continuation the poison rule allows.
                p.metrics.retries.labels(retry).inc()
            elif not p.retries.may_retry(retry):
                break
        return last or unavailable("no replica could serve the request")

    async def _try(
        self,
        fwd: Forward,
        attempt: Attempt,
        lease: ReplicaLease,
        content_out: bytes,
        headers: dict,
        seen: dict,
    ) -> Response | tuple[str | None, Response]:
        """One attempt: the client's response, or (why to retry or None, the response so far)."""
        p = self.p
        cfg = p.config
        replica = attempt.replica
        try:
            resp, content = await p.client.exchange(
                attempt, fwd.path, content_out, headers, cfg.request_timeout_s
            )
        except (httpx.HTTPError, TimeoutError) as exc:
            outcome = attempt.outcome(exc)
            if outcome.kind == "timeout":
                lease.give_back(None, failed=True)  # slow, not sick: not held against it
                return APIError(
                    504,
                    f"replica {replica.name} did not answer within {cfg.request_timeout_s:.0f} s; "
                    "the request was not sent elsewhere (it may still be running)",
                    code="timeout",
                ).response()
            lease.give_back(False, outcome.message)
            last = unavailable(f"replica {replica.name} failed: {outcome.message}")
            if outcome.kind == "not_sent":
                return "connect", last
            verdict = await p.judge.judge_death(fwd, attempt, outcome, seen)
            if verdict == "poison":
                return poison_error(f"this request took replica {replica.name} down").response()
            return outcome.kind, last
        if resp.status_code >= 500:
            answer = await self._replica_error(fwd, attempt, lease, resp, content, seen)
            if isinstance(answer, Response):
                return answer
            return answer, passthrough(resp, content)
        lease.give_back(True)  # 4xx is the client's doing, not the replica's
        if resp.status_code < 300:
            fwd.usage = usage_of(json_or_none(content))
        out = passthrough(resp, content)
        out.headers["x-replica"] = replica.name
        return out

    async def _replica_error(
        self, fwd: Forward, attempt: Attempt, lease: ReplicaLease, resp, content: bytes, seen: dict
    ) -> Response | str:
        """A 5xx answer: the response to give the client, or why to retry it elsewhere."""
        p = self.p
        replica = attempt.replica
        outcome = error_outcome(json_or_none(content))
        if outcome.kind == "draining":  # it shuts down: refused before it ran, and no failure
            lease.give_back(True)
            p.table.saw_draining(replica.name)
            return "draining"
        if outcome.kind == "internal_error" and resp.status_code == 500:
            # The engine failed this request alone and went on: it would fail anywhere.
            lease.give_back(True, failed=True)
            await p.judge.strike(fwd)
            return passthrough(resp, content)
        if outcome.kind == "engine_dead":
            lease.give_back(False, f"HTTP {resp.status_code}: {outcome.message}")
            verdict = await p.judge.judge_death(fwd, attempt, outcome, seen)
            if verdict == "poison":
                return poison_error(f"this request took replica {replica.name} down").response()
            return "engine_dead"
        # A 503 is a busy replica shedding load: try another, but it is not sick.
        lease.give_back(resp.status_code == 503, f"HTTP {resp.status_code}", failed=True)
        return f"http_{resp.status_code}"
