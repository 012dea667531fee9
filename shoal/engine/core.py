"""The engine core: requests in token ids, steps out as token deltas.

The core is the scheduler, the KV cache manager and an executor running the model; it checks and
admits requests, runs steps (retrying a failed step request by request, so that one bad request
fails alone), and reports each step as a StepResult. It makes no text: tokenizing, detokenizing
and stop strings belong to the fronts (LLMEngine for callers on one thread, AsyncEngine for the
server), which tell the core of a stop string by `stop_request`."""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import torch

from shoal.engine.block_pool import BlockPool
from shoal.engine.config import EngineConfig
from shoal.engine.executor import build_executor
from shoal.engine.expert_balance import ExpertBalancer
from shoal.engine.faults import FaultConfig, InjectedCrash, InjectedStepError
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.kv_connector.packing import PackedKV
from shoal.engine.kv_connector.scheduler_side import KVConnectorScheduler
from shoal.engine.kv_tiers import KVTierIndex
from shoal.engine.lora_manager import LoRAManager
from shoal.engine.outputs import EngineCoreOutput
from shoal.engine.parallel.executor import ExecutorDeadError
from shoal.engine.request import Request
from shoal.engine.request_checks import EngineBrokenError, RequestRejectedError, check_token_ids
from shoal.engine.runner_setup import DTYPES, kv_dtype_of, pool_block_bytes, tier_spec
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.scheduler import Scheduler
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.engine.speculative import SpecDecodeStats
from shoal.engine.step_pipeline import StepPipeline
from shoal.engine.step_result import EngineStats, StepResult, StepTimes
from shoal.engine.step_trace import StepTrace
from shoal.models.loader import LoadedModel, describe_model, load_model
from shoal.models.lora_layers import slot_bytes
from shoal.protocol.block_hash import adapter_keys, root_hash

log = logging.getLogger(__name__)

# Steps in a row in which every request failed: the fault is the engine's, not a request's.
MAX_FAILED_STEPS = 3


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = DTYPES[config.dtype]
        cache = config.cache
        parallel = config.parallel
        if loaded is None and parallel.world_size > 1:
            # The ranks load the weights, each its own slices; this process needs the rest.
            loaded = describe_model(config.model, dtype=dtype, quantization=config.quantization)
        elif loaded is None:
            loaded = load_model(
                config.model, dtype=dtype, device=config.device, quantization=config.quantization
            )
        self.loaded = loaded
        log.info(
            "%s: weights %s (--quantization %s)",
            loaded.name,
            loaded.quantization or f"unquantized {config.dtype}",
            config.quantization or "none",
        )
        # The fronts' tokenizer; the core reads only its end-of-sequence ids (and, for the fault
        # hook of tests, decodes a prompt).
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        block_bytes = pool_block_bytes(config, mcfg)
        lora = config.lora
        kv_budget = cache.kv_cache_memory
        if lora.enable_lora:
            if parallel.world_size > 1:
                raise ValueError("LoRA adapters with tensor or pipeline parallelism are not supported yet")
            # The adapter slots come out of the KV budget: the memory plan holds both.
            adapter_dtype = lora.weights_dtype(dtype, self.loaded.quantization is not None)
            kv_budget -= lora.max_loras * slot_bytes(mcfg, lora.max_lora_rank, adapter_dtype)
        num_blocks = cache.num_blocks or max(0, kv_budget) // block_bytes
        if num_blocks < 2:
            raise ValueError("the KV cache budget holds fewer than 2 blocks; raise kv_cache_memory")
        model_len = config.scheduler.max_model_len or mcfg.max_position_embeddings
        self.max_model_len = min(model_len, num_blocks * cache.block_size, mcfg.max_position_embeddings)
        if self.max_model_len < model_len:
            log.warning("max_model_len lowered to %d: the KV pool holds no more", self.max_model_len)
        pool = BlockPool(num_blocks, cache.enable_prefix_caching, cache.enable_kv_events)
        tiers = tier_spec(config, mcfg) if cache.enable_prefix_caching else None
        index = KVTierIndex(tiers.host_blocks, tiers.disk_blocks) if tiers is not None else None
        self.kv = KVCacheManager(pool, cache.block_size, root_hash(cache.hash_salt), index)
        eos = self.tokenizer.eos_token_ids
        self.kv_connector = KVConnectorScheduler()
        self.lora = LoRAManager(lora.max_loras, mcfg, lora.max_lora_rank) if lora.enable_lora else None
        for name, path in lora.lora_modules.items():
            self.lora.add(name, path)
        self.experts = ExpertBalancer.for_model(mcfg, config.parallel)
        self.scheduler = Scheduler(
            config.scheduler, self.kv, self.max_model_len, eos, self.kv_connector, self.lora, self.experts
        )
        self.executor = build_executor(config, loaded, num_blocks, self.max_model_len)
        costs = self.executor.tier_costs() if self.kv.tiers is not None else None
        if costs is not None:
            self.kv.tiers.calibrate(costs)  # timed once, before any request
        self.pipeline = None
        if self.executor.max_in_flight > 1:
            self.pipeline = StepPipeline(
                self.scheduler,
                self.executor,
                self.executor.max_in_flight,
                self._check_faults,
                self._execute_parts,
            )
        self.spec_stats = SpecDecodeStats(config.speculative.num_speculative_tokens)
        self._seeds = random.Random(config.seed)
        self.faults = FaultConfig.from_env()
        self.step_trace = StepTrace.from_env()
        self._marked: dict[str, str] = {}  # request id -> the fault its prompt triggers
        self._failed_steps = 0
        self.num_failed_requests = 0
        self.num_steps = 0
        self.last_step: SchedulerOutput | None = None  # what the last step ran (shoal profile reads it)
        self.times = StepTimes()
        # (slots holding K/V, slots allocated) after the last step; kept only when asked, as it
        # walks every running request (the offline benchmark's waste figure).
        self.measure_occupancy = False
        self.last_kv_occupancy = (0, 0)

    def adapters(self) -> LoRAManager:
        """The LoRA adapters the engine knows and holds (RequestRejectedError when it takes none)."""
        if self.lora is None:
            raise RequestRejectedError("LoRA adapters are not enabled (--enable-lora)", "lora_name")
        return self.lora

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    # --- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        prior_output_ids: list[int] | None = None,
        hold_kv: bool = False,
        external_kv: PackedKV | None = None,
        lora: str | None = None,
    ) -> Request:
        """`prior_output_ids` resumes a request: tokens it already produced (on another replica)
        after the prompt. They count as output for limits, penalties and the seeded draw of each
        position, so the rest comes out as it would have; only new tokens are reported.

        Disaggregation: `hold_kv` keeps the request's blocks after it finishes, for `export_kv`
        (until `release_kv`); `external_kv` is the prompt's K/V computed by another engine, loaded
        instead of computed here."""
        params = params or SamplingParams()
        prior = list(prior_output_ids or [])
        if request_id in self.scheduler.groups:
            raise RequestRejectedError(f"request id {request_id!r} is already in use", "request_id")
        ids = list(prompt_token_ids)
        check_token_ids(self.loaded.config.vocab_size, ids, prior, params)
        if not ids:
            raise RequestRejectedError("the prompt is empty", "prompt")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise RequestRejectedError(
                f"the prompt has {len(ids)} tokens; this model's maximum context length is {limit} tokens "
                "including at least one generated token",
                "prompt",
                "context_length_exceeded",
            )
        if len(ids) + len(prior) >= limit:
            raise RequestRejectedError(
                f"the prompt and prior output have {len(ids) + len(prior)} tokens; this model's maximum "
                f"context length is {limit} tokens",
                "prompt",
                "context_length_exceeded",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if params.min_tokens > max_tokens:
            raise RequestRejectedError(
                f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this request may generate",
                "min_tokens",
            )
        if len(ids) + max_tokens > limit:
            raise RequestRejectedError(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion)",
                "max_tokens",
                "context_length_exceeded",
            )
        if lora is not None and (self.lora is None or lora not in self.lora.adapters):
            raise RequestRejectedError(f"the adapter {lora!r} does not exist", "model", "model_not_found")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = Request(
            request_id,
            ids + prior,
            params,
            max_tokens=max_tokens,
            seed=seed,
            priority=priority,
            arrival_time=arrival_time,
            num_prompt_tokens=len(ids),
            lora=lora,
        )
        if external_kv is not None:
            req.external_kv = self._check_external_kv(req, external_kv)
        if hold_kv and not self.executor.moves_kv:
            raise RequestRejectedError(
                "a parallel engine cannot hand its K/V to another yet", "kv_transfer_params"
            )
        req.hold_kv = hold_kv
        if self.faults.active:
            self._mark_faults(request_id, ids)
        self.scheduler.add_request(req)
        return req

    def _check_external_kv(self, req: Request, packed: PackedKV) -> PackedKV:
        if not self.executor.moves_kv:
            raise RequestRejectedError("K/V from another engine does not load into a parallel engine yet")
        cfg = self.loaded.config
        shape = (cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
        try:
            return self.kv.check_external(req, packed, shape, kv_dtype_of(self.config))
        except (ValueError, AttributeError) as exc:
            raise RequestRejectedError(str(exc), "kv_transfer_params") from None

    def export_kv(self, request_id: str) -> PackedKV:
        """The K/V of a finished request held with `hold_kv`: its computed tokens, packed."""
        req = self.kv_connector.held.get(request_id)
        if req is None:
            raise KeyError(f"no K/V is held for request {request_id!r}")
        n = min(req.num_computed_tokens, req.num_prompt_tokens)
        data = self.executor.export_kv(self.kv.block_ids(request_id), n)
        return PackedKV(n, self.kv.block_hashes(req, n), data)

    def pack_new_handoffs(self) -> dict[str, PackedKV]:
        """The K/V of the requests held for a handoff since the last call, packed now, between
        steps: what the front hands a decode worker without waiting for the steps that follow."""
        ids = self.kv_connector.take_newly_held() if self.executor.moves_kv else []
        return {rid: self.export_kv(rid) for rid in ids}

    def export_prefix(self, hashes: list[int]) -> PackedKV | None:
        """The K/V of the longest run of a prompt's block chain `hashes`, from its first block, that
        this engine holds in its pool or offload tiers, packed (None: not even the first): for a
        peer that would otherwise compute them. Taken between steps, so no tier move is pending."""
        if not self.executor.moves_kv:
            raise RequestRejectedError("a parallel engine cannot hand its K/V to another yet")
        sources = self.kv.held_prefix(hashes)
        n = len(sources) * self.kv.block_size
        return PackedKV(n, hashes[: len(sources)], self.executor.export_blocks(sources)) if n else None

    def prompt_hashes(self, ids: list[int], lora: str | None = None) -> list[int]:
        """The block chain a prompt has here (what a peer is asked for)."""
        return self.kv.prompt_hashes(ids, adapter_keys(lora))

    def release_kv(self, request_id: str) -> bool:
        return self.scheduler.release_kv(request_id)

    def _mark_faults(self, request_id: str, ids: list[int]) -> None:
        """Test hook (see shoal.engine.faults): crash now, or fail this request's steps."""
        text = self.tokenizer.decode(ids)
        if self.faults.crash_on and self.faults.crash_on in text:
            self._marked[request_id] = "crash"
        elif self.faults.step_error_on and self.faults.step_error_on in text:
            self._marked[request_id] = "step_error"
        elif self.faults.sampled_error_on and self.faults.sampled_error_on in text:
            self._marked[request_id] = "sampled_error"

    def abort_request(self, request_id: str) -> bool:
        self._marked.pop(request_id, None)
        return bool(self.scheduler.abort(request_id))

    def stop_request(self, request_id: str, stop: str) -> str | None:
        """The front found stop string `stop` in this choice's text: it is finished. Returns the
        request's group id when no choice of the group is left running (no step reports it again)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish_by_stop_string(req, stop)
        return req.group_id if req.group_id not in self.scheduler.groups else None

    def has_unfinished_requests(self) -> bool:
        # Steps still in flight count: their results must be taken back.
        return self.scheduler.num_unfinished > 0 or (self.pipeline is not None and self.pipeline.busy)

    # --- stepping ------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One step: token deltas per choice that moved or finished, and what the front needs
        besides (finished groups, KV events, stats)."""
        outputs = self._step_outputs()
        stats = self.stats()
        if self.experts is not None:
            self.experts.observe(stats.moe_expert_tokens)
        finished = {co.group_id for co in outputs if co.group_id not in self.scheduler.groups}
        return StepResult(outputs, finished, self.kv.pool.take_events(), stats)

    def _step_outputs(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        if self.pipeline is not None:
            so, result, failures = self.pipeline.step()
            if so is None or so.empty:
                return []
            if not failures:
                self._failed_steps = 0
        else:
            so = self.scheduler.schedule()
            result, failures = self._execute(so)
            if so.empty:
                return []
        self.num_steps += 1
        self.last_step = so
        if self.measure_occupancy:
            self.last_kv_occupancy = self._occupancy(so)
        for rid in failures:
            self._marked.pop(rid, None)
        failed = [r for rid, err in failures.items() if (r := self.scheduler.fail(rid, err)) is not None]
        for req in failed:
            self.scheduler.abort(req.group_id)  # its sibling choices end with it
        self.num_failed_requests += len(failed)
        self.spec_stats.observe(result.spec_results)
        changed = self.scheduler.update_from_output(so, result)
        outputs = self._core_outputs(changed + failed, result)
        elapsed = time.perf_counter() - t0
        self.times.add(result, elapsed)
        if self.step_trace is not None:
            self.step_trace.add(so, elapsed, self.scheduler.num_unfinished)
        return outputs

    def _core_outputs(self, reqs: list[Request], result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outs: dict[str, EngineCoreOutput] = {}
        for req in reqs:
            new = req.token_ids[req.num_prompt_tokens + req.num_emitted :]  # not its whole output
            req.num_emitted += len(new)
            outs[req.request_id] = EngineCoreOutput(
                req.request_id,
                req.group_id,
                req.index,
                new,
                result.logprobs.get(req.request_id, [])[: len(new)],
                finish_reason=req.status.value if req.is_finished else None,
                stop_reason=req.stop_reason,
                num_cached_tokens=max(0, req.num_cached_tokens),
                error=req.error,
                arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time,
            )
        for rid in result.prompt_logprobs.keys() | result.embeddings.keys():
            co = outs.setdefault(rid, EngineCoreOutput(rid, rid, 0))
            co.prompt_logprobs = result.prompt_logprobs.get(rid)
            co.embedding = result.embeddings.get(rid)
        return list(outs.values())

    def _check_faults(self, so: SchedulerOutput) -> None:
        faults = {self._marked.get(c.request_id) for c in so.scheduled} if self._marked else ()
        if "crash" in faults:
            raise InjectedCrash("injected crash")
        if "step_error" in faults:
            raise InjectedStepError("injected step error")

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._check_faults(so)
        result = self.executor.execute_model(so)
        if self._marked and any(self._marked.get(c.request_id) == "sampled_error" for c in so.scheduled):
            raise InjectedStepError("injected step error after sampling")
        return result

    def _execute(self, so: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, str]]:
        """Runs the step. When it raises, runs each request's part alone, so that the requests
        whose part fails are failed and every other one goes on as if nothing happened (a part
        is safe to run again: K/V slots are rewritten with the same values, the runner rolls back
        what the failed attempt sampled, and a draw depends on the seed and position only)."""
        try:
            result = self._run(so)
            self._failed_steps = 0
            return result, {}
        except ExecutorDeadError:
            raise  # no request's fault: the ranks are gone
        except Exception as exc:
            if not so.scheduled:
                raise
            return self._execute_parts(so, exc)

    def _execute_parts(self, so: SchedulerOutput, exc: Exception) -> tuple[ModelRunnerOutput, dict[str, str]]:
        """After the whole step raised `exc`: each request's part alone."""
        log.error("a step of %d requests failed", len(so.scheduled), exc_info=exc)
        if len(so.scheduled) == 1:  # nothing to tell apart: the one request is the culprit
            only = so.scheduled[0].request_id
            return ModelRunnerOutput(), self._after_failures(1, {only: _describe(exc)})
        merged, failures = ModelRunnerOutput(), {}
        for c in so.scheduled:
            part = SchedulerOutput(
                step_id=so.step_id,
                scheduled=[c],
                new_requests=[n for n in so.new_requests if n.request_id == c.request_id],
                finished_ids=list(so.finished_ids),
                may_admit=True,  # (so no part queues a successor the next part would drop)
            )
            try:
                r = self._run(part)
            except ExecutorDeadError:
                raise
            except Exception as exc:
                log.warning("request %s failed in its step: %r", c.request_id, exc)
                failures[c.request_id] = _describe(exc)
                continue
            merged.merge(r)
        return merged, self._after_failures(len(so.scheduled), failures)

    def _after_failures(self, num_chunks: int, failures: dict[str, str]) -> dict[str, str]:
        """Counts steps in which every request failed; enough in a row is the engine's fault."""
        self._failed_steps = self._failed_steps + 1 if len(failures) == num_chunks else 0
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise EngineBrokenError(f"every request failed in {self._failed_steps} steps in a row")
        return failures

    def _occupancy(self, so) -> tuple[int, int]:
        """(slots holding K/V, slots allocated) right after the forward, before anything is freed."""
        step_tokens = {c.request_id: c.num_tokens for c in so.scheduled}
        return self.kv.occupancy(self.scheduler.running, step_tokens)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=pool.usage,
            num_free_blocks=pool.num_free_blocks,
            num_blocks=pool.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            num_evictions=pool.num_evictions,
            spec=self.spec_stats.snapshot() if self.config.speculative.speculative else None,
            ranks=[dataclasses.replace(s) for s in self.executor.rank_stats or []] or None,
            num_waiting_tokens=sum(r.num_tokens for r in self.scheduler.waiting),
            num_kv_held=self.kv_connector.num_held,
            num_steps=self.num_steps,
            **dataclasses.asdict(self.times),
            lora=self.lora.stats() if self.lora is not None else None,
            kv_offload_saved=dict(tiers.saved) if (tiers := self.kv.tiers) is not None else None,
            kv_offload_loaded=dict(tiers.loaded) if tiers is not None else None,
            moe_expert_tokens=self.executor.expert_load(),
            moe_balance=self.experts.snapshot() if self.experts is not None else None,
        )

    def take_kv_events(self) -> list:
        """KV events not yet reported by a step (those of aborts between steps, say)."""
        return self.kv.pool.take_events()

    def expire_held_kv(self, timeout_s: float) -> list[str]:
        """Frees held K/V that nobody took within timeout_s (its taker died, or never came)."""
        return self.scheduler.expire_held(timeout_s)

    def check_health(self) -> None:
        """Raises when the executor can no longer run steps (a rank died between steps)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.step_trace is not None:
            self.step_trace.close()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
