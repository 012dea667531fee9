"""Continuous-batching scheduler without phases.

Each step hands a token budget first to running requests (in priority order), then to waiting
ones. A request simply asks for `num_tokens - num_computed_tokens` tokens: a decode asks for one,
a prompt asks for all of it and is chunked when the budget is short, a prefix hit starts it
further along, and a preempted request starts over (recompute). Nothing else distinguishes them.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from shoal.engine.config import SchedulerConfig
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request, RequestStatus
from shoal.engine.sampling_params import SamplingParams
from shoal.protocol.seeds import derive_seed


@dataclass
class NewRequestData:
    """What the model runner keeps about a request across steps (sampling state)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)  # produced before (a resumed request)


@dataclass
class ScheduledChunk:
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ):
        self.cfg = cfg
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}
        self._unseen: set[str] = set()  # requests the runner has not been told about
        self._finished_ids: list[str] = []  # runner state to drop at the next step
        self.num_preemptions = 0
        self._reserve = int(cfg.admission_watermark * kv.pool.num_blocks)

    # --- queue management ----------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.groups.setdefault(req.group_id, []).append(req)
        self._unseen.add(req.request_id)
        self._enqueue(req)

    def fail(self, request_id: str, error: str) -> Request | None:
        """Finishes one request whose step failed; the rest of its batch goes on."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        req.error = error
        req.pending_children = 0  # its n-1 siblings were never forked: the choice set fails whole
        self._finish(req, RequestStatus.FINISHED_ERROR)
        return req

    def abort(self, group_id: str) -> list[Request]:
        aborted = [r for r in self.groups.get(group_id, ()) if not r.is_finished]
        for req in aborted:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return aborted

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        group = self.groups.get(req.group_id)
        if (
            group is not None
            and all(r.is_finished for r in group)
            and not any(r.pending_children for r in group)
        ):
            del self.groups[req.group_id]
        if req.request_id in self._unseen:
            self._unseen.discard(req.request_id)
        else:
            self._finished_ids.append(req.request_id)

    def _preempt(self, victim: Request, scheduled: dict[str, int]) -> int:
        """Frees the victim's blocks and requeues it; returns the budget it gives back."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(victim)
        return scheduled.pop(victim.request_id, 0)

    # --- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted = False
        self.running.sort(key=lambda r: r.sort_key)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.can_allocate(req, n):
                victim = self.running[-1]  # worst priority, then newest
                budget += self._preempt(victim, scheduled)
                preempted = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            self.kv.allocate(req, n)
            scheduled[req.request_id] = n
            budget -= n
            i += 1

        # After a preemption the pool is short: admitting new work now would only thrash.
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not preempted:
            req = self.waiting[0]
            wants_prompt_logprobs = req.params.prompt_logprobs is not None
            cached = [] if wants_prompt_logprobs else self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.kv.can_allocate(req, n, cached, reserve=self._reserve):
                victim = self.running[-1] if self.running else None
                if victim is not None and victim.priority > req.priority:
                    budget += self._preempt(victim, scheduled)
                    continue
                break
            self.waiting.pop(0)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                self.kv.record_prefix_lookup(req.num_prompt_tokens, num_cached)
            req.num_computed_tokens = num_cached
            self.kv.allocate(req, n, cached)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled[req.request_id] = n
            budget -= n

        return self._build_output(scheduled)

    def _build_output(self, scheduled: dict[str, int]) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        for rid, n in scheduled.items():
            req = self.requests[rid]
            if rid in self._unseen:
                self._unseen.discard(rid)
                out.new_requests.append(
                    NewRequestData(rid, req.prompt_token_ids, req.params, req.seed, req.output_token_ids)
                )
            start = req.num_computed_tokens
            out.chunks.append(
                ScheduledChunk(
                    request_id=rid,
                    token_ids=req.token_ids[start : start + n],
                    start_pos=start,
                    block_ids=self.kv.block_ids(rid),
                    sample=start + n == req.num_tokens,
                )
            )
            out.num_batched_tokens += n
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advances requests by the step's results; returns those that got a token or finished."""
        changed = []
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted (or failed) while the step ran
            req.num_computed_tokens += len(chunk.token_ids)
            self.kv.commit(req)
            if not chunk.sample:
                continue
            if req.max_tokens == 0:  # prompt scoring: the prefill was the whole job
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                changed.append(req)
                continue
            token = sampled[chunk.request_id]
            req.token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            changed.append(req)
            if req.pending_children:
                self._fork_children(req)
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status)
        return changed

    def finish_by_stop_string(self, req: Request, stop: str) -> None:
        if not req.is_finished:
            req.stop_reason = stop
            self._finish(req, RequestStatus.FINISHED_STOPPED)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if token in req.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fork_children(self, parent: Request) -> list[Request]:
        children = []
        for index in range(1, parent.pending_children + 1):
            child = Request(
                f"{parent.group_id}#{index}",
                parent.prompt_token_ids,
                parent.params,
                max_tokens=parent.max_tokens,
                seed=derive_seed(parent.seed, index),
                priority=parent.priority,
                arrival_time=parent.arrival_time,
                extra_keys=parent.extra_keys,
                group_id=parent.group_id,
                index=index,
            )
            child.pending_children = 0
            self.requests[child.request_id] = child
            self.groups[parent.group_id].append(child)
            self._unseen.add(child.request_id)
            child.num_computed_tokens = self.kv.fork(parent, child)
            child.num_cached_tokens = child.num_computed_tokens
            child.first_scheduled_time = time.monotonic()
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            children.append(child)
        parent.pending_children = 0
        return children
