"""Runs one scheduled step: builds the flattened batch and attention metadata, runs the model,
computes logits only for rows that sample, and samples."""

from __future__ import annotations

import math
import mmap
import time
from itertools import accumulate
from pathlib import Path

import torch

from shoal.engine.attention import AttentionMetadata
from shoal.engine.block_tables import BlockTables
from shoal.engine.decode_ahead import DecodeAhead, TokensOnTheWay
from shoal.engine.forward_paths import ForwardPath, GraphOptions, build_forward_paths
from shoal.engine.kv_connector.worker_side import KVConnectorWorker
from shoal.engine.kv_tier_store import KVTierStore
from shoal.engine.kv_tiers import TierSpec
from shoal.engine.outputs import TokenLogprob
from shoal.engine.parallel.comm import StageLink
from shoal.engine.pooling import PromptPooler
from shoal.engine.sampler import Sampler, SamplingState, token_logprobs
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.engine.speculative import Proposer
from shoal.engine.step_inputs import ScheduledChunk, StepInputs
from shoal.engine.structured import GrammarBackend
from shoal.models.config import ModelConfig
from shoal.models.llama import LlamaForCausalLM
from shoal.models.lora_layers import LoRASlots
from shoal.models.moe import place_experts

PROMPT_LOGPROBS_ROWS = 256


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On CPU it sits on an anonymous mapping, which the OS guarantees to be zero and
    faults in page by page: a 2 GiB pool costs nothing at startup instead of seconds of memset.
    (Slots are gathered before they are written and masked out, so they must hold zeros, not NaN.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        eos_token_ids: frozenset[int],
        device: torch.device | str = "cpu",
        graphs: GraphOptions | None = None,
        kv_dtype: torch.dtype | None = None,
        grammars: GrammarBackend | None = None,
        proposer: Proposer | None = None,
        max_proposal_batch: int | None = None,
        stage: StageLink | None = None,
        lora: LoRASlots | None = None,
        kv_tiers: TierSpec | None = None,
        decode_ahead: bool | None = None,
    ):
        """`stage`: under pipeline parallelism, where this stage's input comes from and its output
        goes. Only the last stage computes logits and samples. `lora`: the model's adapter slots
        (its projections wrapped to add each row's adapter). `kv_tiers`: the KV offload tiers this
        runner keeps the bytes of. `decode_ahead`: queue each greedy decode step's successor
        before reading its tokens (engine.decode_ahead); None: where CUDA graphs run."""
        self.lora = lora
        self.lora_slot_of: dict[str, int] = {}  # requests that run with an adapter
        self.model = model
        self.stage = stage
        self.samples = model.shard.is_last_stage
        self.proposer = proposer
        self.max_proposal_batch = max_proposal_batch
        self.cfg = model.cfg
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        dtype = model.dtype
        kv_dtype = kv_dtype or dtype
        use_graphs = graphs is not None and graphs.usable(self.device, block_size)
        # With CUDA graphs, one more block that no sequence owns takes the K/V of padded rows.
        slots = (num_blocks + use_graphs) * block_size
        shape = (slots, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.kv_caches = [
            (zeroed(shape, kv_dtype, self.device), zeroed(shape, kv_dtype, self.device))
            for _ in range(self.cfg.num_layers)
        ]
        self.kv_connector = KVConnectorWorker(block_size, self.device)
        self.kv_connector.register(self.kv_caches)
        self.tier_store = None
        if kv_tiers is not None:
            root = None
            if kv_tiers.disk_blocks:  # each rank its own folder: it holds its own shard
                shard = model.shard
                root = str(Path(kv_tiers.disk_root) / f"tp{shard.tp_rank}-pp{shard.pp_rank}")
            self.tier_store = KVTierStore(self.kv_caches, block_size, kv_tiers.host_blocks, root)
        self._tier_step = -1  # the step whose tier moves ran (a retried step must not move twice)
        self.forward_paths = build_forward_paths(
            model, self.kv_caches, block_size, self.device, graphs if use_graphs else None, num_blocks
        )
        self.attention = self.forward_paths.attention
        self.inputs = StepInputs(
            block_size,
            self.device,
            self.cfg.sliding_window,
            self.attention.decode_in_groups,
            self.forward_paths.wants_token_batch,
        )
        self.sampler = Sampler(eos_token_ids, self.cfg.vocab_size, grammars)
        self.states: dict[str, SamplingState] = {}
        self.tables = BlockTables()
        if decode_ahead is None:
            decode_ahead = use_graphs
        alone = stage is None and model.shard.tp_size == 1 and lora is None  # one process, one model
        self.ahead = DecodeAhead(self.tables, block_size) if decode_ahead and alone else None
        # Requests that ask for more than a token per step (their step's work is skipped for the
        # rest): prompt logprobs, a grammar.
        self.prompt_logprob_ids: set[str] = set()
        self.structured_ids: set[str] = set()
        # Requests for an embedding of their prompt (the last stage's: it holds the final norm).
        self.pooler = PromptPooler(model.norm if self.samples else None)
        self._applied_step: dict[str, int] = {}  # the step whose table changes a request has taken

    def _update_states(self, so: SchedulerOutput) -> None:
        """Takes the step's changes to request state. Safe to repeat: a failed step is run again
        request by request with the same SchedulerOutput, and its sampled tokens are rolled back."""
        if so.kv_tier_moves and self._tier_step != so.step_id:
            # First: a block evicted this step is saved before anything this step writes in it.
            self._tier_step = so.step_id
            self.tier_store.apply(so.kv_tier_moves)
        if self.lora is not None:
            for slot, adapter in so.lora_loads:
                self.lora.load(slot, adapter)
        if so.expert_placement is not None:
            place_experts(self.model, so.expert_placement)  # the same on every rank: in step
        for rid in so.finished_ids:
            self.lora_slot_of.pop(rid, None)
            self.states.pop(rid, None)
            self.tables.drop(rid)
            self.prompt_logprob_ids.discard(rid)
            self.structured_ids.discard(rid)
            self.pooler.drop(rid)
            self._applied_step.pop(rid, None)
            if self.proposer is not None:
                self.proposer.drop(rid)
        for new in so.new_requests:
            if self._applied_step.get(new.request_id) == so.step_id:
                continue
            if new.external_kv is not None:  # its prompt's K/V came from another engine
                self.import_kv(new.block_ids, new.external_kv)
            if new.lora_slot:
                self.lora_slot_of[new.request_id] = new.lora_slot
            if not self.samples:  # an earlier pipeline stage keeps only the block table
                self.tables.put(new.request_id, new.block_ids)
                self._applied_step[new.request_id] = so.step_id
                continue
            state = SamplingState(new.params, new.seed, new.prompt_token_ids, list(new.output_token_ids))
            if new.params.structured is not None:
                if self.sampler.grammars is None:
                    raise ValueError("structured output needs a grammar backend (the engine's tokenizer)")
                # A resumed request's grammar picks up after the tokens it already produced. If
                # that raises, nothing is kept: the request's part of the retried step raises again.
                state.matcher = self.sampler.grammars.matcher(new.params.structured, state.output_token_ids)
                self.structured_ids.add(new.request_id)
            if new.params.prompt_logprobs is not None:
                self.prompt_logprob_ids.add(new.request_id)
            if new.params.pooling is not None:
                self.pooler.add(new.request_id, new.params.pooling)
            self.states[new.request_id] = state
            self.tables.put(new.request_id, new.block_ids)
            self._applied_step[new.request_id] = so.step_id
        for sr in so.scheduled:
            if sr.new_block_ids and self._applied_step.get(sr.request_id) != so.step_id:
                self.tables.extend(sr.request_id, sr.new_block_ids)
                self._applied_step[sr.request_id] = so.step_id
            if sr.sample and self.samples:
                # What an earlier attempt at this step sampled is undone here, whatever failed
                # after it: the sampling state is always the scheduler's.
                self.states[sr.request_id].follow(sr.start_pos, sr.token_ids)

    def export_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The K/V of a request's first num_tokens tokens, packed (see engine.kv_connector)."""
        return self.kv_connector.save(block_ids, num_tokens)

    def export_blocks(self, sources: list[tuple[str, int]]) -> torch.Tensor:
        """Whole blocks' K/V, packed ([layers, 2, tokens, kv_heads, head_dim]), each from the pool
        ("pool", block id) or an offload tier ("host", slot) or ("disk", hash)."""
        parts = []
        for tier, ref in sources:
            if tier == "pool":
                parts.append(self.export_kv([ref], self.block_size))
            else:
                parts.append(self.tier_store.read(tier, ref).cpu())
        return torch.cat(parts, dim=2)

    def import_kv(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.kv_connector.load(block_ids, data)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if not so.scheduled:
            return ModelRunnerOutput()
        chunks = [
            ScheduledChunk(
                sr.request_id,
                sr.token_ids + sr.spec_token_ids if sr.spec_token_ids else sr.token_ids,
                sr.start_pos,
                sr.sample,
                len(sr.spec_token_ids),
            )
            for sr in so.scheduled
        ]
        if self.samples and self.structured_ids:
            for c in chunks:
                state = self.states[c.request_id]
                if c.sample and not c.num_spec and state.matcher is not None:
                    state.next_mask = self.sampler.grammars.prefetch(state.matcher)
        # Single-token rows first, shortest context first, so that rows of similar length share
        # one batched attention call. (Every pipeline stage orders them alike.)
        chunks.sort(key=lambda c: (len(c.token_ids) > 1, c.start_pos))
        input_ids, positions, md = self._prepare(chunks)
        if self.lora is not None:
            slot_of = self.lora_slot_of
            if slot_of:
                rows = [slot_of.get(c.request_id, 0) for c in chunks for _ in c.token_ids]
                self.lora.batch.set_rows(rows, self.device)
            else:
                self.lora.batch.clear()
        received = None
        if self.stage is not None and self.stage.prev_rank is not None:
            received = self.stage.recv(len(input_ids))
        t0 = time.perf_counter()
        if self._decodes_greedily(chunks, md):
            out = self._greedy_step(so, chunks, input_ids, positions, md)
            out.forward_s = time.perf_counter() - t0
            return out
        dropped = self.ahead is not None and self.ahead.drop()
        hidden = self.forward_paths.pick(md).forward(input_ids, positions, md, received)
        if not self.samples:
            self.stage.send(hidden)
            return ModelRunnerOutput(forward_s=time.perf_counter() - t0)
        out = self._sample(chunks, hidden)
        out.queue_dropped = dropped
        out.forward_s = time.perf_counter() - t0
        return out

    def _decodes_greedily(self, chunks: list[ScheduledChunk], md: AttentionMetadata) -> bool:
        """Whether the step is greedy decoding alone (a fast path's single-token rows, each plain
        greedy, no logprobs asked): its tokens are the argmax of its logits, read in one go."""
        if self.ahead is None or md.token_batch is None or self.proposer is not None:
            return False
        for c in chunks:
            if len(c.token_ids) != 1 or not c.sample or c.num_spec:
                return False
            state = self.states[c.request_id]
            if not state.plain_greedy or state.params.logprobs is not None:
                return False
            if c.request_id in self.prompt_logprob_ids or c.request_id in self.pooler:
                return False
        return True

    def _greedy_step(self, so: SchedulerOutput, chunks, input_ids, positions, md) -> ModelRunnerOutput:
        """A greedy decode step: the one queued by the last step when it is this one, else run
        now; then its successor is queued (unless it cannot be the next step) before the tokens
        are read."""
        ahead, ids = self.ahead, [c.request_id for c in chunks]
        tokens, dropped = ahead.take(ids, input_ids, positions, md)
        out = ModelRunnerOutput(from_queue=tokens is not None, queue_dropped=dropped)
        if tokens is None:
            tokens = self._greedy_tokens(input_ids, positions, md)
        states = [self.states[rid] for rid in ids]
        # A row that ends by length with this token leaves the batch: its successor would differ.
        ending = any(
            s.params.max_tokens is not None and len(s.output_token_ids) + 1 >= s.params.max_tokens
            for s in states
        )
        nxt = None if so.may_admit or ending else ahead.next_inputs(ids, positions)
        if nxt is not None:
            ahead.queue(ids, nxt, self._greedy_tokens(tokens.tokens, nxt.token_batch.context_lens - 1, nxt))
        values = tokens.read()
        ahead.fed(values)
        for rid, state, tok in zip(ids, states, values):
            state.advance([tok])
            out.sampled[rid] = [tok]
        return out

    def _greedy_tokens(self, input_ids, positions, md: AttentionMetadata) -> TokensOnTheWay:
        hidden = self.forward_paths.pick(md).forward(input_ids, positions, md, None)
        return TokensOnTheWay(self.model.compute_logits(hidden).argmax(dim=-1))

    def _sample(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> ModelRunnerOutput:
        """Logits for the rows that sample (gathered once), and the step's tokens from them."""
        out = ModelRunnerOutput()
        ends = list(accumulate(len(c.token_ids) for c in chunks))
        if self.prompt_logprob_ids:
            for c, end in zip(chunks, ends):
                if c.request_id in self.prompt_logprob_ids:
                    self._prompt_logprobs(c, hidden, end - len(c.token_ids), out)
        pooler = self.pooler
        if pooler:
            for c, end in zip(chunks, ends):
                if c.request_id in pooler:
                    prompt_len = len(self.states[c.request_id].prompt_token_ids)
                    rows = hidden[end - len(c.token_ids) : end]
                    vec = pooler.take(c.request_id, rows, c.start_pos, prompt_len)
                    if vec is not None:
                        out.embeddings[c.request_id] = vec
        # (an embedding's request samples nothing: its prompt was the whole job)
        sampling = [(c, end) for c, end in zip(chunks, ends) if c.sample and c.request_id not in pooler]
        if not sampling:
            return out
        num_rows = sum(c.num_sampled_rows for c, _ in sampling)
        if num_rows == len(hidden):  # every row samples (decode and verify rows): no gather
            logits = self.model.compute_logits(hidden)
        else:
            rows = [r for c, end in sampling for r in range(end - c.num_sampled_rows, end)]
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        firsts = list(accumulate((c.num_sampled_rows for c, _ in sampling), initial=0))
        plain = [(c, first) for (c, _), first in zip(sampling, firsts) if not c.num_spec]
        if plain:
            if len(plain) == num_rows:
                rows_logits = logits
            else:
                rows_logits = logits[torch.tensor([i for _, i in plain], device=self.device)]
            states = [self.states[c.request_id] for c, _ in plain]
            tokens = self.sampler(rows_logits, states)
            logprobs = self.sampler.logprobs(rows_logits, tokens, states)
            sampled = out.sampled
            for (c, _), state, tok, lp in zip(plain, states, tokens, logprobs):
                state.advance([tok])
                sampled[c.request_id] = [tok]
                if lp is not None:
                    out.logprobs[c.request_id] = [lp]
        if len(plain) < len(sampling):
            for (c, _), i in zip(sampling, firsts):
                if c.num_spec:
                    self._verify(out, c, logits[i : i + c.num_spec + 1])
        cap = self.max_proposal_batch
        if self.proposer is not None and (cap is None or len(sampling) <= cap):
            out.proposed = self.proposer.propose(
                {c.request_id: self.states[c.request_id] for c, _ in sampling}
            )
        return out

    def _verify(self, out: ModelRunnerOutput, c: ScheduledChunk, logits: torch.Tensor) -> None:
        """Keeps the proposed tokens the model agrees with, and one of its own after them."""
        state = self.states[c.request_id]
        drafts = c.token_ids[-c.num_spec :]
        tokens = self.sampler.verify(logits, state, drafts)
        lps = []
        if state.params.logprobs is not None:
            views = [state.ahead(tokens[:j]) for j in range(len(tokens))]
            lps = [lp for lp in self.sampler.logprobs(logits[: len(tokens)], tokens, views) if lp is not None]
        out.spec_results[c.request_id] = (c.num_spec, len(tokens) - 1)
        self._record(out, c.request_id, tokens, lps)

    def _record(self, out: ModelRunnerOutput, rid: str, tokens: list[int], lps: list[TokenLogprob]) -> None:
        self.states[rid].advance(tokens)
        out.sampled[rid] = tokens
        if lps:
            out.logprobs[rid] = lps

    def _prompt_logprobs(self, c: ScheduledChunk, hidden: torch.Tensor, row: int, out: ModelRunnerOutput):
        """Logprobs of the prompt tokens that this chunk's rows predict, for requests that ask."""
        state = self.states[c.request_id]
        top_n = state.params.prompt_logprobs
        prompt = state.prompt_token_ids
        end = min(c.start_pos + len(c.token_ids), len(prompt) - 1)
        if top_n is None or c.start_pos >= end:
            return
        found: list[TokenLogprob] = []
        # Full-vocabulary logits for a long chunk are large; take them a slice at a time.
        for lo in range(c.start_pos, end, PROMPT_LOGPROBS_ROWS):
            hi = min(lo + PROMPT_LOGPROBS_ROWS, end)
            rows = hidden[row + lo - c.start_pos : row + hi - c.start_pos]
            found += token_logprobs(
                self.model.compute_logits(rows), prompt[lo + 1 : hi + 1], [top_n] * (hi - lo)
            )
        out.prompt_logprobs[c.request_id] = (c.start_pos + 1, found)

    def _prepare(self, chunks: list[ScheduledChunk], reference_too: bool = False):
        return self.inputs.prepare(chunks, self.tables, reference_too)

    def time_bare_decode(self, batch: int, context: int, repeats: int) -> float:
        """Median seconds of the model's part of a decode step of `batch` rows at `context`
        tokens each: forward, logits and argmax over inputs prepared once, with none of the
        engine's bookkeeping (benchmarks/step_cost.py sets a step's time against it). Writes
        K/V into the first blocks of the pool: only for a runner with no requests."""
        chunks = [ScheduledChunk(str(r), [r + 7], context - 1, True) for r in range(batch)]
        return self._time_forward(chunks, context, repeats, logits=True)

    def time_bare_prefill(self, num_tokens: int, repeats: int) -> float:
        """Median seconds of the model's forward over a prompt of `num_tokens` tokens, as one
        chunk (what loading its K/V from an offload tier saves). Only for a runner with no requests."""
        chunk = ScheduledChunk("prompt", [7 + i for i in range(num_tokens)], 0, False)
        return self._time_forward([chunk], num_tokens, repeats, logits=False)

    def _time_forward(self, chunks: list[ScheduledChunk], context: int, repeats: int, logits: bool) -> float:
        """Writes K/V into the first blocks of the pool (each chunk's own): the pool must be idle."""
        per_row = -(-context // self.block_size)
        tables = BlockTables(len(chunks), per_row)
        for r, c in enumerate(chunks):
            tables.put(c.request_id, [(r * per_row + j) % self.num_blocks for j in range(per_row)])
        keep, self.tables = self.tables, tables
        try:
            ids, pos, md = self._prepare(chunks)
        finally:
            self.tables = keep
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 2):  # two to warm up
                t0 = time.perf_counter()
                hidden = self.forward_paths.pick(md).forward(ids, pos, md, None)
                if logits:
                    self.model.compute_logits(hidden).argmax(dim=-1).tolist()
                times.append(time.perf_counter() - t0)
        return sorted(times[2:])[len(times[2:]) // 2]

    def tier_costs(self) -> dict[str, float]:
        """Seconds to bring one block into the pool from each offload tier, and to compute one
        ("compute"), measured now; only before any request runs."""
        costs = self.tier_store.time_loads(repeats=5) if self.tier_store is not None else {}
        costs["compute"] = self.time_bare_prefill(self.block_size, repeats=3)
        return costs

    def close(self) -> None:
        """Lets go of what outlives the process otherwise (the disk tier's folder)."""
        if self.tier_store is not None:
            self.tier_store.close()

    @property
    def fused_decoder(self):
        """The fused C decoder (engine.cpu_decode), when its path is on."""
        return _decoder(self.forward_paths.named("cpu_fused"))

    @property
    def graph_decoder(self):
        """The CUDA graph decoder (engine.cuda_graphs), when its path is on."""
        return _decoder(self.forward_paths.named("cuda_graphs"))


def _decoder(path: ForwardPath | None):
    return None if path is None else path.decoder
