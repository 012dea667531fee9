"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router scores every expert
for each token, the top k experts' MLPs run on it, and their outputs are summed, weighted by the
router's (softmax) probabilities, renormalised over the k when the model says so; Qwen2-MoE adds a
shared expert that every token takes, scaled by a sigmoid gate of its own.

The step's tokens are grouped by expert (one stable sort of their choices), and each expert that
any token chose runs once, on all of its tokens: one product per active expert, no loop over
tokens. An expert is an ordinary gated MLP of two projections, so the int8 and int4 modes
(models/quant.py) quantize experts like any other projection and run them on the same kernels.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
from torch import nn

from shoal.models.config import ModelConfig
from shoal.models.ops import silu_mul
from shoal.models.parallel import expert_spans


class ExpertMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up in one projection."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """Its output is whole on every rank: `all_reduce` sums the ranks' partial outputs (the
    layer's, over its tensor-parallel ranks), or `dispatch` (models/moe_dispatch.py), under expert
    parallelism by all-to-all, trades the tokens with the experts' ranks and gathers the output."""

    def __init__(self, cfg: ModelConfig, all_reduce=None, dispatch=None):
        super().__init__()
        self.all_reduce, self.dispatch = all_reduce, dispatch
        # Time in collectives, all told: getting tokens to their experts, and the outputs back.
        self.dispatch_ns = self.combine_ns = 0
        # The routed experts in one call (engine/cpu_experts.py), given by the engine where its
        # kernels run; None, or its answer None, leaves them to the loop below.
        self.fused = None
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        # Under expert parallelism a rank holds experts offset .. offset + len(experts) - 1; every
        # rank routes every token, and the ranks' partial sums add up in the layer's all-reduce
        # (or, with a dispatch, each routes its share and trades tokens by all-to-all).
        self.offset = cfg.expert_offset
        self.rank = cfg.expert_rank
        self.owners = expert_owners(cfg.num_experts, cfg.expert_ranks)
        # Load balancing (engine/expert_balance.py): replicated experts and the ranks holding them,
        # the owner first (each takes an even run of the expert's tokens); this rank's replicas.
        self.holders: dict[int, list[int]] = {}
        self.replicas = nn.ModuleDict()
        local = cfg.num_experts if cfg.num_local_experts is None else cfg.num_local_experts
        self.experts = nn.ModuleList(
            ExpertMLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(local)
        )
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = ExpertMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # Tokens each expert has taken, all told (the engine's /metrics read it).
        self.expert_tokens: torch.Tensor | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] (float32)."""
        probs = torch.softmax(self.gate(h).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.dispatch is not None:
            return self.dispatch(self, h)
        experts, weights = self.route(h)
        out = self.run_experts(h, experts, weights)
        self.add_shared(h, out)
        if self.all_reduce is not None:
            with self.combining():
                self.all_reduce(out)
        return out

    @contextlib.contextmanager
    def dispatching(self):
        """Counts the time inside into dispatch_ns."""
        t0 = time.perf_counter_ns()
        yield
        self.dispatch_ns += time.perf_counter_ns() - t0

    @contextlib.contextmanager
    def combining(self):
        """Counts the time inside into combine_ns."""
        t0 = time.perf_counter_ns()
        yield
        self.combine_ns += time.perf_counter_ns() - t0

    def add_shared(self, h: torch.Tensor, out: torch.Tensor) -> None:
        if hasattr(self, "shared_expert"):
            out += torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)

    def run_experts(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over each token's choices of weight x expert(token), expert by expert."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # choices grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.gate.out_features)
        self.count(counts)
        scale = weights.reshape(-1)[order].to(h.dtype)
        return self._run(h, order // self.top_k, scale, self._work(counts, split=True))

    def _work(self, counts: torch.Tensor, split: bool) -> list[tuple[int, nn.Module, int, int]]:
        """(expert, module, first, end) for each expert this rank runs on choices first .. end - 1
        of the sorted ones (`counts` per expert); `split`: a replicated expert's choices are
        shared out among its holders, this rank taking its even run of them."""
        ends = torch.cumsum(counts, 0).tolist()
        work = []
        for e, module in self.computed_here():
            start, end = (ends[e - 1] if e else 0), ends[e]
            held = self.holders.get(e) if split else None
            if held is not None:
                i, n = held.index(self.rank), end - start
                start, end = start + i * n // len(held), start + (i + 1) * n // len(held)
            if end > start:
                work.append((e, module, start, end))
        return work

    def _run(self, h: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None, work: list):
        """out[rows[j]] += scale[j] x expert(h[rows[j]]) for each expert's choices j (scale None: 1)."""
        out = self.fused(h, rows, scale, work) if self.fused is not None else None
        return out if out is not None else self.run_in_torch(h, rows, scale, work)

    def run_in_torch(self, h: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None, work: list):
        """_run's reference path: one product per expert in torch."""
        out = torch.zeros_like(h)
        for _, module, start, end in work:
            tokens = rows[start:end]
            y = module(h[tokens])
            out.index_add_(0, tokens, y if scale is None else y * scale[start:end].unsqueeze(1))
        return out

    def destinations(self, experts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The rank that runs each choice (`experts`, made for `tokens`, by their row in the step):
        its expert's owner, or for a replicated expert, its holders in turn by token."""
        ranks = torch.tensor(self.owners, device=experts.device)[experts]
        for e, held in self.holders.items():
            chosen = experts == e
            ranks[chosen] = torch.tensor(held, device=experts.device)[tokens[chosen] % len(held)]
        return ranks

    def run_received(self, rows: torch.Tensor, expert_of: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each received row through the expert it is for (`expert_of`; `counts` per expert),
        unweighted: its sender weighs it."""
        order = torch.argsort(expert_of, stable=True)
        return self._run(rows, order, None, self._work(counts, split=False))

    def computed_here(self):
        """(expert, module) of each expert whose tokens this rank computes (some of them, when
        it is replicated): its own, then its replicas, by expert id."""
        own = [(self.offset + i, m) for i, m in enumerate(self.experts)]
        if not self.replicas:
            return own
        return sorted(own + [(int(e), m) for e, m in self.replicas.items()], key=lambda em: em[0])

    def place(self, holders: dict[int, list[int]], all_gather) -> None:
        """Takes a new placement of replicas. Every rank runs this with the same placement: an
        expert replicated on a new rank has its tensors gathered from its owner (all_gather over
        the ranks, the others sending zeros of the same shapes), kept by the ranks that hold it."""
        template = self.experts[0]
        for e in sorted(holders):
            added = [r for r in holders[e][1:] if r not in self.holders.get(e, [])]
            if not added:
                continue
            owner = self.owners[e]
            source = self.experts[e - self.offset] if owner == self.rank else template
            tensors = {}
            for name, t in source.state_dict().items():
                sent = t if owner == self.rank else torch.zeros_like(t)
                tensors[name] = all_gather(sent)[owner]
            if self.rank in added:
                replica = copy.deepcopy(template)
                replica.load_state_dict(tensors)
                self.replicas[str(e)] = replica
        for e in list(self.replicas):
            if self.rank not in holders.get(int(e), [])[1:]:
                del self.replicas[e]
        self.holders = {e: list(held) for e, held in holders.items()}

    def count(self, counts: torch.Tensor) -> None:
        """Takes the step's tokens per expert, all of the model's (this rank keeps its own)."""
        counts = counts[self.offset : self.offset + len(self.experts)]
        if self.expert_tokens is None:
            self.expert_tokens = torch.zeros_like(counts)
        self.expert_tokens += counts

    def expert_load(self) -> list[int]:
        """Tokens each expert has taken."""
        return [0] * len(self.experts) if self.expert_tokens is None else self.expert_tokens.tolist()


def expert_owners(num_experts: int, ranks: int) -> list[int]:
    """The rank owning each expert under expert parallelism."""
    return [r for r, span in enumerate(expert_spans(num_experts, ranks)) for _ in range(span.size)]


def place_experts(model: nn.Module, placement: dict[int, dict[int, list[int]]]) -> None:
    """Applies a placement of replicated experts (by the index of the layer in the whole model)
    to this rank's sparse layers."""
    first = model.shard.layers.start
    for i, moe in sparse_layers(model).items():
        moe.place(placement.get(first + i, {}), model.comm.all_gather)


def sparse_layers(model: nn.Module) -> dict[int, SparseMoE]:
    """The model's mixture-of-experts blocks, by the index of their layer."""
    mlps = {i: getattr(layer, "mlp", None) for i, layer in enumerate(model.layers)}
    return {i: mlp for i, mlp in mlps.items() if isinstance(mlp, SparseMoE)}


def merge_expert_load(parts: list[dict[int, tuple[int, list[int]]] | None]) -> dict[int, list[int]] | None:
    """Ranks' counts of their own experts (first expert's id, counts, by layer) as one model's."""
    merged: dict[int, dict[int, int]] = {}
    for part in parts:
        for layer, (first, counts) in (part or {}).items():
            merged.setdefault(layer, {}).update({first + e: n for e, n in enumerate(counts)})
    return {layer: [c[e] for e in sorted(c)] for layer, c in sorted(merged.items())} or None


# --- checkpoint names ------------------------------------------------------------------------

MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's expert tensors
FUSED_PARTS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
FUSED_PARTS |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def unpack_experts(name: str, tensor: torch.Tensor):
    """A checkpoint tensor as per-expert tensors: transformers' packed layout holds a layer's
    experts in one tensor (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]);
    the other layout, and every other tensor, pass as they are."""
    for packed in ("gate_up_proj", "down_proj"):
        if name.endswith(f"experts.{packed}") and tensor.dim() == 3:
            base = name.removesuffix(packed)
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.{packed}.weight", tensor[e]
            return
    yield name, tensor


def module_name(name: str, params) -> tuple[str, str | None]:
    """The parameter a checkpoint tensor (named as in HF, less "model.") fills, and the part of a
    fused projection it is (q_proj, gate_proj...) or None: attention's and a dense MLP's tensors
    sit on the layer itself, an MoE layer's under its `mlp`."""
    name = name.replace("self_attn.", "").replace("block_sparse_moe.", "mlp.")
    for short, part in MIXTRAL_PARTS.items():
        name = name.replace(f".{short}.", f".{part}.")
    if ".mlp." in name and name.split(".mlp.")[0] + ".mlp.gate.weight" not in params:
        name = name.replace("mlp.", "")  # a dense layer's MLP
    for part, fused in FUSED_PARTS.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), part
    return name, None
