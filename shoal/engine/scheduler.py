"""Continuous-batching scheduler without phases.

Each step hands a token budget first to running requests (in priority order), then to waiting
ones. A request simply asks for `num_tokens - num_computed_tokens` tokens: a decode asks for one,
a prompt asks for all of it and is chunked when the budget is short, a prefix hit starts it
further along, and a preempted request starts over (recompute). Nothing else distinguishes them.
A decoding request may also carry tokens proposed for it (speculative decoding): they ride along
in lookahead slots, and the runner says how many were right.

Priorities: lower values first, in the running order, in admission, and in preemption. A prompt
of a better priority than some running request also has its steps to itself: worse-priority
requests sit those steps out (keeping their blocks), so an interactive request's time to first
token does not pay for batch work beside it. A request sits out at most HOLD_STEPS steps in a
row, so a steady stream of better prompts slows it but cannot stop it.
"""

from __future__ import annotations

import bisect
import time

from shoal.engine.config import SchedulerConfig
from shoal.engine.expert_balance import ExpertBalancer
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.kv_connector.scheduler_side import KVConnectorScheduler
from shoal.engine.lora_manager import LoRAManager
from shoal.engine.request import Request, RequestStatus
from shoal.engine.scheduler_output import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from shoal.protocol.seeds import derive_seed

HOLD_STEPS = 16  # steps in a row a worse-priority request may sit out for better prompts


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        connector: KVConnectorScheduler | None = None,
        lora: LoRAManager | None = None,
        experts: ExpertBalancer | None = None,
    ):
        """`connector`: the KV connector's scheduler side (K/V that arrives from outside, and
        blocks held for a handoff). `lora`: the adapter slots, taken as requests are admitted.
        `experts`: where a new placement of replicated experts comes from, to go with a step."""
        self.lora = lora
        self.experts = experts
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
        self._new_blocks: dict[str, list[int]] = {}  # blocks added to tables in this step
        self._step_id = 0
        # Requests in a step whose results have not come back (pipeline parallel keeps several
        # steps in flight): they sit out later steps, and are never preempted mid-flight.
        self.in_flight: set[str] = set()
        self._pool_full = False  # (see schedule: the queue's head found no blocks last time)
        self.connector = connector or KVConnectorScheduler()
        self.num_preemptions = 0
        self._held_back: dict[str, int] = {}  # request id -> steps sat out in a row
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

    def release_kv(self, request_id: str) -> bool:
        """Frees a finished request's held blocks (its K/V was taken, or is no longer wanted)."""
        req = self.connector.release(request_id)
        if req is not None:
            self.kv.free(req)
        return req is not None

    def expire_held(self, timeout_s: float) -> list[str]:
        """Frees held K/V that nobody took within timeout_s (its taker died, or never came)."""
        late = self.connector.expired(timeout_s)
        for rid in late:
            self.release_kv(rid)
        return late

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if req.lora_slot:
            self.lora.release(req.lora)
            req.lora_slot = 0
        if not self.connector.request_finished(req):  # else its K/V is wanted elsewhere
            self.kv.free(req)
        self.requests.pop(req.request_id, None)
        group = self.groups.get(req.group_id)
        if (
            group is not None
            and all(r.is_finished for r in group)
            and not any(r.pending_children for r in group)
        ):
            del self.groups[req.group_id]
        self._forget(req)

    def _forget(self, req: Request) -> None:
        """The runner drops the request's state at the next step (if it ever had any)."""
        req.spec_token_ids = []
        self._new_blocks.pop(req.request_id, None)
        self._held_back.pop(req.request_id, None)
        if req.request_id in self._unseen:
            self._unseen.discard(req.request_id)
        else:
            self._finished_ids.append(req.request_id)

    def _preempt(self, victim: Request, scheduled: dict[str, int]) -> int:
        """Frees the victim's blocks and requeues it; returns the budget it gives back. The
        runner forgets it, and hears of it again as new (with its output so far) when it resumes."""
        self.running.remove(victim)
        self.kv.free(victim)
        self._forget(victim)
        if not victim.is_finished:
            self._unseen.add(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(victim)
        return scheduled.pop(victim.request_id, 0)

    def _allocate(self, req: Request, n: int, **kw) -> bool:
        added = self.kv.allocate_slots(req, n, **kw)
        if added is None:
            return False
        if added and req.request_id not in self._unseen:
            self._new_blocks.setdefault(req.request_id, []).extend(b.block_id for b in added)
        return True

    def _speculative_tokens(self, req: Request, n: int, budget: int) -> list[int]:
        """The proposed tokens that may ride along with a decode: within the budget, and never
        more than the request may still produce (its max_tokens, the context)."""
        if n != 1 or not req.spec_token_ids:
            return []
        room = min(
            budget - n,
            req.max_tokens - req.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        return req.spec_token_ids[: max(0, room)]

    # --- one step ------------------------------------------------------------------------

    def _victim(self) -> Request | None:
        """The running request to preempt: worst priority, then newest; never one in flight."""
        return next((r for r in reversed(self.running) if r.request_id not in self.in_flight), None)

    def _urgent_priority(self) -> float:
        """The best priority with a prompt to compute (waiting, or running and not yet through its
        prompt), when it is better than some running request's; else no limit (infinity)."""
        prompts = [
            r.priority
            for r in self.running
            if r.num_computed_tokens < r.num_prompt_tokens and r.request_id not in self.in_flight
        ]
        if self.waiting and len(self.running) < self.cfg.max_num_seqs:
            prompts.append(self.waiting[0].priority)
        best = min(prompts, default=None)
        if best is None or all(r.priority <= best for r in self.running):
            return float("inf")
        return best

    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """`max_seqs` caps the requests in this step (pipeline parallel spreads the running ones
        over the steps it keeps in flight)."""
        budget = self.cfg.max_num_batched_tokens
        cap = max_seqs or self.cfg.max_num_seqs
        scheduled: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        preempted = False
        self.running.sort(key=lambda r: r.sort_key)
        urgent = self._urgent_priority()

        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < cap:
            req = self.running[i]
            if req.request_id in self.in_flight:
                i += 1
                continue
            if req.priority > urgent:
                held = self._held_back.get(req.request_id, 0)
                if held < HOLD_STEPS:
                    self._held_back[req.request_id] = held + 1
                    i += 1
                    continue
            self._held_back.pop(req.request_id, None)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._speculative_tokens(req, n, budget)
            stuck = False
            while not self._allocate(req, n, num_lookahead_tokens=len(drafts)):
                if drafts:  # the pool is short: drop the guesses before preempting anyone
                    drafts = []
                    continue
                victim = self._victim()
                if victim is None:  # all the others are in flight: try again next step
                    stuck = True
                    break
                budget += self._preempt(victim, scheduled) + len(spec.pop(victim.request_id, []))
                preempted = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING or stuck:
                break
            scheduled[req.request_id] = n
            if drafts:
                spec[req.request_id] = drafts
            budget -= n + len(drafts)
            i += 1

        # After a preemption the pool is short: admitting new work now would only thrash.
        # A request whose adapter finds no slot (each holds an adapter in use) steps aside for the
        # requests behind it (the base model's, or a resident adapter's) and keeps its place.
        no_slot: list[Request] = []
        self._pool_full = False  # the head of the queue found no blocks (not the budget or cap)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.cfg.max_num_seqs
            and len(scheduled) < cap
            and not preempted
            and self.waiting[0].priority <= urgent
        ):
            req = self.waiting[0]
            every_row = req.params.needs_every_row
            external = self.connector.num_external_tokens(req)
            cached = [] if every_row or external else self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            # Blocks past the pool's prefix that an offload tier holds arrive like external K/V.
            tiered = 0 if every_row or external else self.kv.find_tiered(req, len(cached))
            tiered_tokens = tiered * self.kv.block_size
            n = min(req.num_tokens - num_cached - external - tiered_tokens, budget)
            if req.lora is not None and not req.lora_slot:
                slot = self.lora.acquire(req.lora)
                if slot is None:
                    no_slot.append(self.waiting.pop(0))
                    continue
                req.lora_slot = slot
            ok = self._allocate(
                req, n, cached=cached, num_external_tokens=external + tiered_tokens, reserve=self._reserve
            )
            if not ok:
                victim = self._victim()
                if victim is not None and victim.priority > req.priority:
                    budget += self._preempt(victim, scheduled) + len(spec.pop(victim.request_id, []))
                    continue
                self._pool_full = True
                break
            self.waiting.pop(0)
            if tiered:
                num_cached += self.kv.load_tiered(req, len(cached), tiered) * self.kv.block_size
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                if not external:
                    self.kv.record_prefix_lookup(req.num_prompt_tokens, num_cached)
            req.num_computed_tokens = num_cached + external
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled[req.request_id] = n
            budget -= n
        self.waiting[:0] = no_slot

        return self._build_output(scheduled, spec)

    def _build_output(self, scheduled: dict[str, int], spec: dict[str, list[int]]) -> SchedulerOutput:
        self._step_id += 1
        out = SchedulerOutput(step_id=self._step_id, finished_ids=self._finished_ids)
        if self.kv.tiers is not None:
            out.kv_tier_moves = self.kv.tiers.take_moves()
        if self.lora is not None:
            out.lora_loads = self.lora.take_loads()
        if self.experts is not None:
            out.expert_placement = self.experts.take_placement()
        self._finished_ids = []
        # Waiting requests join the next step only if the batch has room and the pool took the last
        # one asked (blocks are freed by requests that end, which changes the step anyway).
        room = len(self.running) < self.cfg.max_num_seqs and not self._pool_full
        out.may_admit = bool(self.waiting) and room
        self.in_flight.update(scheduled)
        new_blocks, self._new_blocks = self._new_blocks, {}
        for rid, n in scheduled.items():
            req = self.requests[rid]
            if rid in self._unseen:
                self._unseen.discard(rid)
                external = self.connector.take_external(req)
                out.new_requests.append(
                    NewRequestData(
                        rid,
                        req.prompt_token_ids,
                        req.params,
                        req.seed,
                        req.output_token_ids,
                        self.kv.block_ids(rid),
                        external,
                        req.lora_slot,
                    )
                )
            start = req.num_computed_tokens
            drafts = spec.get(rid, [])
            out.scheduled.append(
                ScheduledRequest(
                    request_id=rid,
                    token_ids=req.token_ids[start : start + n],
                    start_pos=start,
                    spec_token_ids=drafts,
                    new_block_ids=new_blocks.get(rid, []),
                    sample=start + n == req.num_tokens,
                )
            )
            out.num_batched_tokens += n + len(drafts)
        return out

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advances requests by the step's results; returns those that got tokens or finished.
        Every stop but a stop string (which needs text, and is found by the front) is decided
        here, token by token: tokens past a stop are dropped."""
        changed = []
        self.in_flight.difference_update(sr.request_id for sr in out.scheduled)
        for sr in out.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted (or failed) while the step ran
            tokens = result.sampled.get(sr.request_id, []) if sr.sample else []
            if sr.sample and req.max_tokens == 0:  # prompt scoring: the prefill was the whole job
                req.num_computed_tokens += len(sr.token_ids)
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                changed.append(req)
                continue
            status, kept = None, 0
            for token in tokens:
                req.token_ids.append(token)
                kept += 1
                status = self._check_stop(req, token)
                if status is not None:
                    break
            # Proposed tokens that were accepted had their K/V computed in this step too.
            accepted = min(len(tokens) - 1, kept) if sr.spec_token_ids and tokens else 0
            req.num_computed_tokens += len(sr.token_ids) + accepted
            self.kv.commit(req)
            req.spec_token_ids = result.proposed.get(sr.request_id, []) if status is None else []
            if not sr.sample:
                continue
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            changed.append(req)
            if req.pending_children:  # the children share the prompt's blocks, before a stop frees them
                self._fork_children(req)
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
            if parent.lora_slot:  # resident: its parent holds it
                child.lora, child.lora_slot = parent.lora, self.lora.acquire(parent.lora)
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
