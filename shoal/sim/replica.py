"""One simulated replica: shoal's own scheduler and KV cache manager (token budget, chunked prefill,
prefix hits, preemption, priorities, all as the engine runs them), with the model's forward
replaced by the profile's cost of each step. Time is the simulator's, never the wall clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from shoal.bench.report import RequestRecord
from shoal.engine.block_pool import BlockPool
from shoal.engine.config import SchedulerConfig
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.request import Request, RequestStatus
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.scheduler import Scheduler
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.engine.step_shape import StepShape, step_shape
from shoal.protocol.bounds import check_bounds
from shoal.sim.profile import NodeProfile
from shoal.sim.workload import SimRequest

OUTPUT_TOKEN = 999  # what every simulated step "samples"; EOS is never it (requests ignore EOS)


@dataclass
class ReplicaShape:
    """The scheduler settings a replica runs with (the profile says what its steps cost)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # Seconds a request spends outside the engine on its way in and out (HTTP, tokenizing, the
    # gateway's hop), added to its latencies; None: what the profile measured of a real server.
    request_overhead_s: float | None = None
    # How far a real step's time strays from its price, step to step (a shared host's scheduling,
    # caches): the standard deviation of log(seconds / price), for steps of decodes only and for
    # steps with prompt tokens. Each step is drawn around its price, one on average, from a
    # generator seeded by the replica's name, so a run repeats. 0: every step costs its price.
    decode_step_noise: float = 0.0
    prompt_step_noise: float = 0.0
    # Which draw of that noise: runs of several, pooled, are the simulator's expectation where
    # one is a single sample of it (one run's TTFT p99 of 128 requests moved by 5-12 % with it).
    noise_seed: int = 0

    def __post_init__(self):
        least = {"max_num_seqs": 1, "max_num_batched_tokens": 1, "request_overhead_s": 0}
        check_bounds(self, {**least, "decode_step_noise": 0, "prompt_step_noise": 0})

    @property
    def noisy(self) -> bool:
        """Whether its steps are drawn around their price rather than priced exactly."""
        return bool(self.decode_step_noise or self.prompt_step_noise)


@dataclass
class HandedKV:
    """A simulated K/V handoff: the tokens it covers, no data."""

    num_tokens: int
    data: None = None


@dataclass
class Tracked:
    record: RequestRecord
    sent: float
    request_id: str = ""


def request_overhead(profile: NodeProfile, shape: ReplicaShape) -> float:
    if shape.request_overhead_s is not None:
        return shape.request_overhead_s
    return profile.serving.get("per_request_s", 0.0)


class SimReplica:
    def __init__(self, name: str, profile: NodeProfile, shape: ReplicaShape, kv_events: bool = False):
        self.name = name
        self.profile = profile
        self.shape = shape
        self.pool = BlockPool(profile.num_kv_blocks, enable_caching=True, enable_events=kv_events)
        self.kv = KVCacheManager(self.pool, profile.block_size)
        cfg = SchedulerConfig(shape.max_num_seqs, shape.max_num_batched_tokens)
        self.scheduler = Scheduler(cfg, self.kv, profile.max_model_len, frozenset())
        self.overhead = request_overhead(profile, shape)
        self.tracked: dict[str, Tracked] = {}
        self.awaited = 0  # requests routed to it whose K/V a prefill worker is computing
        self._arriving: dict[str, int] = {}  # requests whose handed K/V it loads: their tokens
        self.step_ends: float | None = None  # when the step in progress ends (None: idle)
        self._step: SchedulerOutput | None = None
        self.steps = 0
        # The steps' cost as priced, and as run: stretched by cores shared, plus handoffs loaded.
        self.priced_s = self.stepped_s = 0.0
        self.last_sampled = 0  # tokens the last step that ended streamed out
        self._last_arrival = -math.inf
        self.shapes: list[StepShape] | None = None  # a list: each step's shape is kept in it
        self._abandoned: set[str] = set()  # given up on while in the step now running
        seed = f"{name}/{shape.noise_seed}" if shape.noise_seed else name
        self._noise = random.Random(seed) if shape.noisy else None

    @property
    def outstanding(self) -> int:
        """Requests in flight to it, as the gateway counts them."""
        return len(self.tracked) + self.awaited

    def add(
        self,
        req: SimRequest,
        now: float,
        record: RequestRecord,
        sent: float | None = None,
        external_tokens: int = 0,
        max_tokens: int | None = None,
    ) -> None:
        """`sent`: when the client sent it (default now; later for a decode worker's part of a
        disaggregated request); `external_tokens`: prompt tokens whose K/V arrives with it (from a
        prefill worker) instead of being computed here; `max_tokens`: a prefill worker's part
        samples one token, whatever the request asked."""
        if req.prompt is None:
            raise ValueError("the exact simulator needs each prompt's tokens (or use the fast one)")
        room = self.profile.max_model_len - len(req.prompt)
        max_tokens = max_tokens or max(1, min(req.output_len, room))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        # Strictly after the last one, as the engine's clock has it: the scheduler orders requests
        # of one priority by arrival, and a tie would put a preempted request behind newer ones.
        self._last_arrival = max(now, math.nextafter(self._last_arrival, math.inf))
        request = Request(
            req.id,
            req.prompt,
            params,
            max_tokens=max_tokens,
            seed=0,
            priority=req.priority,
            arrival_time=self._last_arrival,
        )
        if external_tokens:
            # What the scheduler reads of a K/V handoff: its length (the data is the worker's).
            request.external_kv = HandedKV(min(external_tokens, len(req.prompt) - 1))
            self._arriving[req.id] = request.external_kv.num_tokens
        self.scheduler.add_request(request)
        self.tracked[req.id] = Tracked(record, now if sent is None else sent, req.id)

    def abandon(self, request_id: str) -> None:
        """The gateway gave up on a request (a remote prefill past its timeout): it leaves the
        queue now, or, in the step now running, when that step ends; the step runs its part all
        the same, as a real engine sees an abort only between its steps."""
        self.tracked.pop(request_id, None)
        if self._step is not None and any(sr.request_id == request_id for sr in self._step.scheduled):
            self._abandoned.add(request_id)
        else:
            self.scheduler.abort(request_id)

    def start_step(self, now: float, stretch: float = 1.0, speed: float = 1.0) -> float | None:
        """Schedules a step at `now`, its profiled cost times `speed` (the host's then, against the
        profile's: drift.py) and that times `stretch` (cores it shares); returns when it ends, or
        None when there is nothing to run."""
        if not self.scheduler.num_unfinished:
            return None
        so = self.scheduler.schedule()
        if so.empty:
            return None
        shape = step_shape(so)
        if self.shapes is not None:
            self.shapes.append(shape)
        priced = self.profile.step_seconds(shape) * speed
        seconds = priced * stretch
        if self._noise is not None:
            sd = self.shape.decode_step_noise if shape.decode_only else self.shape.prompt_step_noise
            seconds *= self._noise.lognormvariate(-sd * sd / 2, sd)  # a mean of one
        for new in so.new_requests:  # handed K/V: read in by its front, loaded by its engine
            if (tokens := self._arriving.pop(new.request_id, None)) is not None:
                seconds += self.profile.kv_handoff_cpu_seconds(tokens, "decode")
        self.priced_s += priced
        self.stepped_s += seconds
        self._step, self.step_ends = so, now + seconds
        self.steps += 1
        return self.step_ends

    def end_step(self, now: float) -> list[Tracked]:
        """The step's tokens arrive at `now`; returns the requests that finished."""
        so, self._step, self.step_ends = self._step, None, None
        sampled = {sr.request_id: [OUTPUT_TOKEN] for sr in so.scheduled if sr.sample}
        self.last_sampled = len(sampled)
        finished = []
        for req in self.scheduler.update_from_output(so, ModelRunnerOutput(sampled=sampled)):
            t = self.tracked.get(req.request_id)
            if t is None:  # abandoned during the step
                continue
            rec = t.record
            if rec.ttft is None:
                rec.ttft = now - t.sent + self.overhead
            rec.chunk_times.append(now + self.overhead)
            rec.output_tokens += 1
            if req.status != RequestStatus.RUNNING:
                rec.ok = req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
                rec.e2e = now - t.sent + self.overhead
                finished.append(self.tracked.pop(req.request_id))
        for request_id in self._abandoned:  # (those the step finished are gone already)
            self.scheduler.abort(request_id)
        self._abandoned.clear()
        return finished
