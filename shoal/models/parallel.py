"""Where one rank of a tensor- and pipeline-parallel model sits: which heads, MLP columns,
vocabulary rows and layers it holds, and which slice of each checkpoint tensor that means.

Megatron's split: q/k/v heads and gate/up columns are split by output rows (column parallel), o_proj
and down_proj by input columns (row parallel, their partial outputs summed across ranks), the
embedding and output head by vocabulary rows. Heads are dealt out in whole KV groups so that every
query head sits with its key/value head; a rank's KV pool then holds only its own KV heads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels.cpu import QK  # quantized blocks run along the input dimension: splits keep to them
from shoal.models.config import ModelConfig

# One expert's tensor ("mlp.experts.3.gate_proj.weight", Mixtral's "block_sparse_moe.experts.3.w1.weight").
_EXPERT = re.compile(r"^(.*\bexperts\.)(\d+)(\..*)$")


class ShardingError(ValueError):
    """The model cannot be split this way (the reason says why and what would work)."""


@dataclass(frozen=True)
class Span:
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


def _even_spans(total: int, parts: int, unit: int = 1) -> list[Span]:
    """`total` split into `parts` contiguous spans of whole `unit`s, sizes differing by one unit at most."""
    units = total // unit
    base, extra = divmod(units, parts)
    spans, start = [], 0
    for i in range(parts):
        size = (base + (i < extra)) * unit
        spans.append(Span(start, size))
        start += size
    spans[-1] = Span(spans[-1].start, total - spans[-1].start)  # the remainder below one unit
    return spans


def row_shares(rows: int, ranks: int) -> list[Span]:
    """A step's rows split among ranks in even runs, in rank order (the first never shorter)."""
    return _even_spans(rows, ranks)


def expert_spans(num_experts: int, ranks: int) -> list[Span]:
    """The experts each rank owns under expert parallelism: even runs, in rank order."""
    return _even_spans(num_experts, ranks)


@dataclass(frozen=True)
class ModelShard:
    """One rank's part of a model: `tp_rank` of `tp_size` within stage `pp_rank` of `pp_size`."""

    cfg: ModelConfig
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # A mixture of experts over the tensor-parallel ranks: whole experts dealt out to them (expert
    # parallelism), or else every expert split like an MLP (tensor parallelism inside experts).
    expert_parallel: bool = False
    # Under expert parallelism: tokens traded by all-to-all instead of summed by all-reduce; the
    # shared expert is then whole on every rank, which runs it on its own share of the tokens.
    expert_all_to_all: bool = False

    def __post_init__(self):
        check_parallel_sizes(self.cfg, self.tp_size, self.pp_size, self.expert_parallel)

    # --- the split ----------------------------------------------------------------------

    @property
    def kv_heads(self) -> Span:
        cfg, tp = self.cfg, self.tp_size
        if cfg.num_kv_heads >= tp:
            return _even_spans(cfg.num_kv_heads, tp)[self.tp_rank]
        # Fewer KV heads than ranks: each KV head is replicated on tp / num_kv_heads ranks.
        return Span(self.tp_rank // (tp // cfg.num_kv_heads), 1)

    @property
    def q_heads(self) -> Span:
        cfg = self.cfg
        if cfg.num_kv_heads >= self.tp_size:
            group = cfg.num_heads // cfg.num_kv_heads
            kv = self.kv_heads
            return Span(kv.start * group, kv.size * group)
        per = cfg.num_heads // self.tp_size
        return Span(self.tp_rank * per, per)

    def _columns(self, size: int) -> Span:
        """This rank's run of an MLP's `size` columns (in whole quantized blocks where they fit)."""
        return _even_spans(size, self.tp_size, QK if size % QK == 0 else 1)[self.tp_rank]

    @property
    def intermediate(self) -> Span:
        return self._columns(self.cfg.intermediate_size)

    @property
    def experts(self) -> Span:
        """The experts this rank holds: its run of them under expert parallelism, else all."""
        if not self.expert_parallel:
            return Span(0, self.cfg.num_experts)
        return expert_spans(self.cfg.num_experts, self.tp_size)[self.tp_rank]

    @property
    def expert_intermediate(self) -> Span:
        """The columns of each expert's MLP this rank holds: all under expert parallelism."""
        size = self.cfg.moe_intermediate_size
        return Span(0, size) if self.expert_parallel else self._columns(size)

    @property
    def shared_intermediate(self) -> Span:
        size = self.cfg.shared_expert_intermediate_size
        return Span(0, size) if self.all_to_all else self._columns(size)

    @property
    def all_to_all(self) -> bool:
        return self.expert_parallel and self.expert_all_to_all and self.tp_size > 1

    @property
    def vocab_per_rank(self) -> int:
        """Rows of every rank's vocabulary slice, the last padded with zero rows to this size."""
        return -(-self.cfg.vocab_size // self.tp_size)

    @property
    def vocab(self) -> Span:
        start = self.tp_rank * self.vocab_per_rank
        return Span(start, max(0, min(self.cfg.vocab_size, start + self.vocab_per_rank) - start))

    @property
    def layers(self) -> Span:
        return _even_spans(self.cfg.num_layers, self.pp_size)[self.pp_rank]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def has_embedding(self) -> bool:
        # With tied weights the last stage's output head is the embedding.
        return self.is_first_stage or (self.is_last_stage and self.cfg.tie_word_embeddings)

    def local_config(self) -> ModelConfig:
        """The config this rank's modules are built from: its own heads, MLP width and layers. The
        vocabulary stays whole: it is what sampling sees."""
        layers = self.layers
        dense = tuple(i - layers.start for i in self.cfg.dense_layers if layers.start <= i < layers.end)
        local = dataclasses.replace(
            self.cfg,
            num_heads=self.q_heads.size,
            num_kv_heads=self.kv_heads.size,
            intermediate_size=self.intermediate.size,
            num_layers=layers.size,
            dense_layers=dense,
        )
        if self.cfg.num_experts and self.tp_size > 1:
            local = dataclasses.replace(
                local,
                expert_rank=self.tp_rank if self.expert_parallel else 0,
                expert_ranks=self.tp_size if self.expert_parallel else 1,
                expert_offset=self.experts.start,
                num_local_experts=self.experts.size,
                moe_intermediate_size=self.expert_intermediate.size,
                shared_expert_intermediate_size=self.shared_intermediate.size,
                expert_all_to_all=self.all_to_all,
            )
        return local

    # --- checkpoint slices --------------------------------------------------------------

    def local_name(self, name: str) -> str | None:
        """The HF tensor name as this rank's model calls it (layers renumbered from its first), or
        None where the tensor is not on this rank."""
        bare = name.removeprefix("model.")
        if bare.startswith("layers."):
            index = int(bare.split(".")[1])
            layers = self.layers
            if not layers.start <= index < layers.end:
                return None
            rest = bare.split(".", 2)[2]
            expert = _EXPERT.match(rest)
            if expert and self.expert_parallel:  # one expert's tensor: on the rank that holds it
                e, experts = int(expert.group(2)), self.experts
                if not experts.start <= e < experts.end:
                    return None
                rest = f"{expert.group(1)}{e - experts.start}{expert.group(3)}"
            return f"model.layers.{index - layers.start}.{rest}"
        if bare.startswith("embed_tokens."):
            return name if self.has_embedding else None
        if bare.startswith(("norm.", "lm_head.")):
            return name if self.is_last_stage else None
        return name

    def slice_of(self, name: str) -> tuple[int, Span] | None:
        """(dimension, span) of the checkpoint tensor that this rank holds; None: all of it."""
        if self.tp_size == 1:
            return None
        d = self.cfg.head_dim
        bare = name.removeprefix("model.")
        if ".experts." in bare:
            return self._expert_slice(bare)
        if ".shared_expert." in bare:
            return (1 if ".down_proj." in bare else 0), self.shared_intermediate
        if ".q_proj." in bare:
            return 0, Span(self.q_heads.start * d, self.q_heads.size * d)
        if ".k_proj." in bare or ".v_proj." in bare:
            return 0, Span(self.kv_heads.start * d, self.kv_heads.size * d)
        if ".o_proj." in bare:
            return 1, Span(self.q_heads.start * d, self.q_heads.size * d)
        if ".gate_proj." in bare or ".up_proj." in bare:
            return 0, self.intermediate
        if ".down_proj." in bare:
            return 1, self.intermediate
        if bare.startswith(("embed_tokens.", "lm_head.")):
            return 0, self.vocab
        return None

    def _expert_slice(self, bare: str) -> tuple[int, Span] | None:
        one = _EXPERT.search(bare) is not None  # one expert's tensor, or a layer's packed ones
        if self.expert_parallel:  # whole experts: this rank's run of the packed ones
            return None if one else (0, self.experts)
        span = self.expert_intermediate
        if bare.endswith(("down_proj.weight", "w2.weight")):
            return 1, span
        if bare.endswith("experts.down_proj"):
            return 2, span
        # A layer's packed gate_up [E, 2I, H] holds this rank's rows in two runs: read whole, and
        # cut by `cut_gate_up` once it is one expert's.
        return (0, span) if one else None

    def cut_gate_up(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of one expert's whole gate_up [2I, H] (its gate's, then its up's)."""
        span, half = self.expert_intermediate, t.shape[0] // 2
        return torch.cat([t.narrow(0, span.start, span.size), t.narrow(0, half + span.start, span.size)])

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole checkpoint tensor (vocabulary rows padded with zeros)."""
        where = self.slice_of(name)
        if where is None:
            return tensor
        dim, span = where
        part = tensor.narrow(dim, span.start, span.size)
        return self.pad_vocab(name, part)

    def pad_vocab(self, name: str, part: torch.Tensor) -> torch.Tensor:
        bare = name.removeprefix("model.")
        if self.tp_size == 1 or not bare.startswith(("embed_tokens.", "lm_head.")):
            return part
        return F.pad(part, (0, 0, 0, self.vocab_per_rank - part.shape[0]))


def all_shards(cfg: ModelConfig, tp: int, pp: int, expert_parallel: bool = False) -> list[ModelShard]:
    """Every rank's shard, by global rank (pipeline stage major, tensor-parallel rank minor)."""
    return [ModelShard(cfg, t, tp, p, pp, expert_parallel) for p in range(pp) for t in range(tp)]


def check_parallel_sizes(cfg: ModelConfig, tp: int, pp: int, expert_parallel: bool = False) -> None:
    """Raises ShardingError, with what would work, where the model does not split this way."""
    if tp < 1 or pp < 1:
        raise ShardingError("tensor and pipeline parallel sizes must be at least 1")
    if pp > cfg.num_layers:
        raise ShardingError(f"pipeline parallel size {pp} exceeds the model's {cfg.num_layers} layers")
    hq, hk = cfg.num_heads, cfg.num_kv_heads
    if tp == 1:
        return
    if cfg.num_experts and expert_parallel and tp > cfg.num_experts:
        raise ShardingError(f"{tp} ranks cannot split {cfg.num_experts} experts: each rank holds whole ones")
    if cfg.num_experts and not expert_parallel and tp > cfg.moe_intermediate_size:
        raise ShardingError(f"{tp} ranks cannot split experts {cfg.moe_intermediate_size} columns wide")
    if cfg.num_experts and cfg.qk_norm and not cfg.qk_norm_per_head:
        raise ShardingError("a q/k norm over the whole projection (olmoe) does not split across ranks yet")
    if hq % hk:
        raise ShardingError(f"{hq} query heads do not group evenly over {hk} KV heads")
    if hk >= tp:
        if tp > cfg.intermediate_size:
            raise ShardingError(f"tensor parallel size {tp} exceeds the MLP width {cfg.intermediate_size}")
        return  # whole KV groups dealt out, as evenly as they go
    if tp % hk == 0 and hq % tp == 0:
        return  # each KV head replicated on tp / hk ranks
    fits = [n for n in range(2, 2 * hq + 1) if n <= hk or (n % hk == 0 and hq % n == 0)]
    raise ShardingError(
        f"tensor parallel size {tp} cannot split {hq} query heads and {hk} KV heads: a size up to {hk} "
        f"splits whole KV groups, a larger one must be a multiple of {hk} that divides {hq}. "
        f"Sizes that work: {fits}"
    )


class VocabParallelEmbedding(nn.Module):
    """An embedding holding only this rank's vocabulary rows; the other ranks' rows come from the
    all-reduce (each token's row is nonzero on exactly one rank, so the sum is exact)."""

    def __init__(self, rows: int, hidden: int, start: int, all_reduce):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start = start
        self.all_reduce = all_reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        here = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(here, local, 0), self.weight)
        x.mul_(here.unsqueeze(-1).to(x.dtype))
        self.all_reduce(x)
        return x
