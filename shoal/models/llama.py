"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch.

The model sees one flat batch of tokens (no padding) and delegates attention to a callable
supplied per forward, so it knows nothing about KV blocks or scheduling.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import triton_ops
from shoal.kernels.cpu import kernels_for
from shoal.models.config import ModelConfig
from shoal.models.moe import SparseMoE, module_name, unpack_experts
from shoal.models.moe_dispatch import ExpertDispatch
from shoal.models.ops import linear, silu_mul
from shoal.models.parallel import ModelShard, VocabParallelEmbedding
from shoal.models.rope import RotaryEmbedding

# A decoder layer's linear projections, in the order its forward runs them.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The fused projections and the checkpoint tensors stacked into each, in order.
PACKED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Communicator(Protocol):
    """Collectives among the tensor-parallel ranks of one stage."""

    world_size: int

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sums `t` across the ranks, in place; every rank gets the same bits."""
        ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's `t`, in rank order."""
        ...

    def all_to_all(self, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows of `t` to each rank (rows[s, d]: how many rank s sends rank d); returns those sent
        to this one, by source."""
        ...


def _no_reduce(t: torch.Tensor) -> None:
    pass


class AttentionFn(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] for this step's tokens; returns [T, Hq, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """residual += delta (in place, when given), then the norm of residual. One fused call on
        CPU and CUDA, where the separate torch ops cost more than the arithmetic at decode sizes."""
        if residual.dim() == 2 and residual.is_contiguous() and triton_ops.fused_ops_for(residual):
            return triton_ops.add_rms_norm(residual, delta, self.weight, self.eps)
        kernels = kernels_for(residual, self.weight, *(() if delta is None else (delta,)))
        if kernels is not None:
            return kernels.add_rms_norm(residual, delta, self.weight, self.eps)
        if delta is not None:
            residual.add_(delta)
        return self(residual)


class DecoderLayer(nn.Module):
    """One layer; under tensor parallelism `cfg` is the rank's own (its heads, its MLP columns) and
    `all_reduce` sums the partial outputs of o_proj and down_proj across ranks."""

    def __init__(self, cfg: ModelConfig, index: int, all_reduce=_no_reduce, dispatch=None):
        super().__init__()
        self.cfg = cfg
        self.index = index
        self.all_reduce = all_reduce
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            per_head = cfg.qk_norm_per_head
            self.q_norm = RMSNorm(cfg.head_dim if per_head else cfg.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim if per_head else cfg.kv_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_sparse(index):
            self.mlp = SparseMoE(cfg, all_reduce, dispatch)
        else:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
            self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def projection_sites(self) -> list[tuple[nn.Module, str, str]]:
        """(module, attribute, checkpoint module path) of each of the layer's projections, the
        experts' included (a router stays as it is: it is small, and decides which experts run)."""
        sites = [(self, "qkv_proj", "self_attn"), (self, "o_proj", "self_attn")]
        mlps = [(self, "mlp")]
        if hasattr(self, "mlp"):
            mlps = [(expert, f"mlp.experts.{e}") for e, expert in enumerate(self.mlp.experts)]
            if hasattr(self.mlp, "shared_expert"):
                mlps.append((self.mlp.shared_expert, "mlp.shared_expert"))
        return sites + [(mlp, name, path) for mlp, path in mlps for name in ("gate_up_proj", "down_proj")]

    def forward(self, x, delta, cos_sin, attn: AttentionFn):
        """x: the residual stream [T, hidden], updated in place; delta: the previous layer's output,
        still to be added to it. Returns this layer's output, likewise not yet added."""
        cfg = self.cfg
        t = x.shape[0]
        h = self.input_layernorm.add_and_norm(x, delta)
        qkv = self.qkv_proj(h)
        heads = cfg.num_heads + cfg.num_kv_heads
        if cfg.qk_norm or cfg.clip_qkv is not None:
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.reshape(t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                if cfg.qk_norm_per_head:
                    q, k = self.q_norm(q), self.k_norm(k)
                else:
                    q, k = self.q_norm(q.reshape(t, -1)).view_as(q), self.k_norm(k.reshape(t, -1)).view_as(k)
            if cfg.clip_qkv is not None:
                c = cfg.clip_qkv
                q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
            qk = RotaryEmbedding.apply(torch.cat([q, k], dim=1), *cos_sin)
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        else:
            # q and k rotate together in one pass: they are adjacent columns of the fused output.
            qk = RotaryEmbedding.apply(
                qkv[:, : cfg.q_size + cfg.kv_size].view(t, heads, cfg.head_dim), *cos_sin
            )
            v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        o = self.o_proj(attn(self.index, q, k, v).reshape(t, cfg.q_size))
        self.all_reduce(o)
        h = self.post_attention_layernorm.add_and_norm(x, o)
        if hasattr(self, "mlp"):
            return self.mlp(h)  # combined across the ranks already
        out = self.down_proj(silu_mul(self.gate_up_proj(h)))
        self.all_reduce(out)
        return out


class LlamaForCausalLM(nn.Module):
    """The whole model, or one rank's part of it (`shard`): its heads and MLP columns of its
    stage's layers, its vocabulary rows, the embedding only on the first stage and the final norm
    and head only on the last. `comm` joins the stage's tensor-parallel ranks."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int | None = None,
        shard: ModelShard | None = None,
        comm: Communicator | None = None,
    ):
        super().__init__()
        self.shard = shard = shard or ModelShard(cfg)
        self.comm = comm
        if shard.tp_size > 1 and comm is None:
            raise ValueError("a tensor-parallel shard needs a communicator")
        reduce = comm.all_reduce if shard.tp_size > 1 else _no_reduce
        self.cfg = cfg = shard.local_config()
        if shard.has_embedding:
            if shard.tp_size > 1:
                self.embed_tokens = VocabParallelEmbedding(
                    shard.vocab_per_rank, cfg.hidden_size, shard.vocab.start, reduce
                )
            else:
                # Given its (empty) weight, so it skips a random init: on the meta device that init
                # imports torch._dynamo, 1.4 s of every start.
                weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
                self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        dispatch = ExpertDispatch(comm, shard.tp_rank, shard.tp_size) if cfg.expert_all_to_all else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, reduce, dispatch) for i in range(cfg.num_layers))
        if shard.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if not cfg.tie_word_embeddings:
                self.lm_head = nn.Linear(cfg.hidden_size, shard.vocab_per_rank, bias=False)
        self.rope = RotaryEmbedding(
            cfg.head_dim,
            max_positions or cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.rope_freq_factors,
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_layernorm.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] (before the last norm). A later pipeline
        stage starts from the previous stage's `hidden` instead of the embedding."""
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        cos_sin = self.rope.tables(positions, x.dtype)
        delta = None
        for layer in self.layers:
            delta = layer(x, delta, cos_sin, attn)
        return x.add_(delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # A quantized model has its own lm_head module, even when its embeddings are tied.
        head = getattr(self, "lm_head", None)
        if head is None or isinstance(head, nn.Linear):
            logits = linear(self.norm(hidden), self.lm_head_weight)
        else:
            logits = head(self.norm(hidden))
        if self.shard.tp_size == 1:
            return logits
        # Each rank has its vocabulary slice's columns: gather them, and drop the padding.
        parts = self.comm.all_gather(logits.contiguous())
        return parts.permute(1, 0, 2).reshape(logits.shape[0], -1)[:, : self.cfg.vocab_size]

    # --- weights -------------------------------------------------------------------------

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], left_out: frozenset[str] = frozenset()
    ) -> None:
        """Loads HF-named tensors, fusing q/k/v and gate/up into their packed parameters. Under
        tensor or pipeline parallelism the tensors are this rank's (see `ModelShard`), named as
        in the whole model; tensors of other stages are skipped. `left_out`: (this rank's) names
        of tensors not given because their parameters are replaced before use (quantization)."""
        cfg = self.cfg
        params = dict(self.named_parameters())
        replaced = {module_name(n.removeprefix("model."), params)[0] for n in left_out}
        qkv_rows = {"q_proj": (0, cfg.q_size), "k_proj": (cfg.q_size, cfg.kv_size)}
        qkv_rows["v_proj"] = (cfg.q_size + cfg.kv_size, cfg.kv_size)
        covered: dict[str, int] = {}  # parameter -> rows loaded
        for full_name, checkpoint_tensor in weights:
            local = self.shard.local_name(full_name)
            if local is None:
                continue
            local = local.removeprefix("model.")
            if "rotary_emb" in local or (local.startswith("lm_head.") and cfg.tie_word_embeddings):
                continue
            for name, tensor in unpack_experts(local, checkpoint_tensor):
                target, part = module_name(name, params)
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the {cfg.architecture} model")
                param = params[target]
                dst = param.data
                whole = part is None and ".experts." in name and name.endswith("gate_up_proj.weight")
                if whole and tensor.shape[0] != dst.shape[0]:  # a packed layer's, read whole
                    tensor = self.shard.cut_gate_up(tensor)
                if part in qkv_rows:
                    dst = dst.narrow(0, *qkv_rows[part])
                elif part is not None:  # gate_proj or up_proj: a half of gate_up_proj
                    half = dst.shape[0] // 2
                    dst = dst.narrow(0, half * PACKED_PARTS["gate_up_proj"].index(part), half)
                if dst.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
                dst.copy_(tensor)
                covered[target] = covered.get(target, 0) + (dst.shape[0] if dst.dim() else 1)
        missing = [
            p
            for p, t in params.items()
            if p not in replaced and covered.get(p, 0) < (t.shape[0] if t.dim() else 1)
        ]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}")
