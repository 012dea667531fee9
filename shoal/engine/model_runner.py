"""Runs one scheduled step: builds the flattened batch and attention metadata, runs the model,
computes logits only for rows that sample, and samples."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from shoal.engine.attention import (
    AttentionMetadata,
    DecodeBatch,
    DecodeGroup,
    PrefillSpan,
    decode_mask,
    group_by_length,
    prefill_mask,
)
from shoal.engine.forward_paths import ForwardPath, GraphOptions, build_forward_paths
from shoal.engine.kv_connector.worker_side import KVConnectorWorker
from shoal.engine.outputs import TokenLogprob
from shoal.engine.parallel.comm import StageLink
from shoal.engine.sampler import Sampler, SamplingState, token_logprobs
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.engine.speculative import Proposer
from shoal.engine.structured import GrammarBackend
from shoal.models.config import ModelConfig
from shoal.models.llama import LlamaForCausalLM

PROMPT_LOGPROBS_ROWS = 256


@dataclass
class ScheduledChunk:
    """One request's rows in the flattened batch, with its block table resolved: its scheduled
    tokens, then any proposed tokens (the last `num_spec` rows), all sampled from when `sample`."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    num_spec: int = 0

    @property
    def num_sampled_rows(self) -> int:
        return (self.num_spec + 1) if self.sample else 0


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
    ):
        """`stage`: under pipeline parallelism, where this stage's input comes from and its output
        goes. Only the last stage computes logits and samples."""
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
        self.forward_paths = build_forward_paths(
            model, self.kv_caches, block_size, self.device, graphs if use_graphs else None, num_blocks
        )
        self.attention = self.forward_paths.attention
        self.sampler = Sampler(eos_token_ids, self.cfg.vocab_size, grammars)
        self.states: dict[str, SamplingState] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._applied_step: dict[str, int] = {}  # the step whose table changes a request has taken

    def _update_states(self, so: SchedulerOutput) -> None:
        """Takes the step's changes to request state. Safe to repeat: a failed step is run again
        request by request with the same SchedulerOutput, and its sampled tokens are rolled back."""
        for rid in so.finished_ids:
            self.states.pop(rid, None)
            self.block_tables.pop(rid, None)
            self._applied_step.pop(rid, None)
            if self.proposer is not None:
                self.proposer.drop(rid)
        for new in so.new_requests:
            if self._applied_step.get(new.request_id) == so.step_id:
                continue
            if new.external_kv is not None:  # its prompt's K/V came from another engine
                self.import_kv(new.block_ids, new.external_kv)
            if not self.samples:  # an earlier pipeline stage keeps only the block table
                self.block_tables[new.request_id] = list(new.block_ids)
                self._applied_step[new.request_id] = so.step_id
                continue
            state = SamplingState(new.params, new.seed, new.prompt_token_ids, list(new.output_token_ids))
            if new.params.structured is not None:
                if self.sampler.grammars is None:
                    raise ValueError("structured output needs a grammar backend (the engine's tokenizer)")
                # A resumed request's grammar picks up after the tokens it already produced. If
                # that raises, nothing is kept: the request's part of the retried step raises again.
                state.matcher = self.sampler.grammars.matcher(new.params.structured, state.output_token_ids)
            self.states[new.request_id] = state
            self.block_tables[new.request_id] = list(new.block_ids)
            self._applied_step[new.request_id] = so.step_id
        for sr in so.scheduled:
            if sr.new_block_ids and self._applied_step.get(sr.request_id) != so.step_id:
                self.block_tables[sr.request_id].extend(sr.new_block_ids)
                self._applied_step[sr.request_id] = so.step_id
            if sr.sample and self.samples:
                # What an earlier attempt at this step sampled is undone here, whatever failed
                # after it: the sampling state is always the scheduler's.
                self.states[sr.request_id].follow(sr.start_pos, sr.token_ids)

    def export_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The K/V of a request's first num_tokens tokens, packed (see engine.kv_connector)."""
        return self.kv_connector.save(block_ids, num_tokens)

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
                sr.token_ids + sr.spec_token_ids,
                sr.start_pos,
                self.block_tables[sr.request_id],
                sr.sample,
                len(sr.spec_token_ids),
            )
            for sr in so.scheduled
        ]
        for c in chunks if self.samples else ():
            state = self.states[c.request_id]
            if c.sample and not c.num_spec and state.matcher is not None:
                state.next_mask = self.sampler.grammars.prefetch(state.matcher)
        # Single-token rows first, shortest context first, so that rows of similar length share
        # one batched attention call. (Every pipeline stage orders them alike.)
        chunks.sort(key=lambda c: (len(c.token_ids) > 1, c.start_pos))
        input_ids, positions, md = self._prepare(chunks)
        received = None
        if self.stage is not None and self.stage.prev_rank is not None:
            received = self.stage.recv(len(input_ids))
        hidden = self.forward_paths.pick(md).forward(input_ids, positions, md, received)
        if not self.samples:
            self.stage.send(hidden)
            return ModelRunnerOutput()

        sample_rows, sampling, row = [], [], 0
        out = ModelRunnerOutput()
        for c in chunks:
            self._prompt_logprobs(c, hidden, row, out)
            row += len(c.token_ids)
            if c.sample:
                first = len(sample_rows)
                sample_rows.extend(range(row - c.num_sampled_rows, row))
                sampling.append((c, first))
        if not sample_rows:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        plain = [(c, i) for c, i in sampling if not c.num_spec]
        if plain:
            rows = logits[torch.tensor([i for _, i in plain], device=self.device)]
            states = [self.states[c.request_id] for c, _ in plain]
            tokens = self.sampler(rows, states)
            logprobs = self.sampler.logprobs(rows, tokens, states)
            for (c, _), tok, lp in zip(plain, tokens, logprobs):
                self._record(out, c.request_id, [tok], [lp] if lp is not None else [])
        for c, i in sampling:
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

    def _padded_tables(self, chunks: list[ScheduledChunk], length: int) -> torch.Tensor:
        """[rows, blocks covering `length`] block tables, shorter ones padded with block 0."""
        width = -(-length // self.block_size)
        rows = [c.block_ids[:width] + [0] * (width - len(c.block_ids[:width])) for c in chunks]
        return torch.tensor(rows, device=self.device)

    def _prepare(self, chunks: list[ScheduledChunk]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for c in chunks:
            ids.extend(c.token_ids)
            for p in range(c.start_pos, c.start_pos + len(c.token_ids)):
                pos.append(p)
                slots.append(c.block_ids[p // bs] * bs + p % bs)
        dev = self.device
        window = self.cfg.sliding_window
        num_decode = sum(1 for c in chunks if len(c.token_ids) == 1)
        ctx = [c.start_pos + 1 for c in chunks[:num_decode]]
        groups, batch = [], None
        if self.attention.decode_in_groups:
            for start, end in group_by_length(ctx):
                length = ctx[end - 1]
                table = self._padded_tables(chunks[start:end], length)
                mask = decode_mask(ctx[start:end], length, window, dev)
                groups.append(DecodeGroup(start, end, length, table, mask))
        elif num_decode:
            # Rows are sorted by context, so the last is the longest.
            table = self._padded_tables(chunks[:num_decode], ctx[-1])
            batch = DecodeBatch(num_decode, table, torch.tensor(ctx, device=dev))
        prefills, row = [], num_decode
        for c in chunks[num_decode:]:
            n = len(c.token_ids)
            context = c.start_pos + n
            table = None if c.start_pos == 0 else torch.tensor(c.block_ids[: -(-context // bs)], device=dev)
            prefills.append(PrefillSpan(row, row + n, context, table, prefill_mask(n, context, window, dev)))
            row += n
        md = AttentionMetadata(torch.tensor(slots, device=dev), groups, prefills, batch)
        if self.forward_paths.wants_token_batch(len(ids), bool(prefills)):
            md.token_batch = self._token_batch(chunks, pos)
        return torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), md

    def _token_batch(self, chunks: list[ScheduledChunk], pos: list[int]) -> DecodeBatch:
        """Each row's block table (its chunk's, padded) and context length (its position + 1)."""
        width = max(-(-(c.start_pos + len(c.token_ids)) // self.block_size) for c in chunks)
        tables = []
        for c in chunks:
            ids = c.block_ids[:width]
            tables.append(torch.tensor(ids + [0] * (width - len(ids))).expand(len(c.token_ids), width))
        return DecodeBatch(len(pos), torch.cat(tables), torch.tensor(pos) + 1)

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
