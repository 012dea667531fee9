"""Architecture description shared by every loader (HF config.json, GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}


@dataclass
class RopeScaling:
    """RoPE frequency scaling; only the llama3 scheme changes frequencies here."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    architecture: str  # a value of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Per-frequency divisors from a GGUF rope_freqs tensor (llama.cpp's form of llama3 scaling).
    rope_freq_factors: tuple[float, ...] | None = None
    # q and k normed per head (qwen3), or across the whole projection (olmoe); clip_qkv clamps
    # q, k and v to [-clip, clip] after it (olmoe).
    qk_norm_per_head: bool = True
    clip_qkv: float | None = None
    # Mixture of experts (models/moe.py): each token's MLP is the weighted sum of top_k of
    # num_experts expert MLPs of moe_intermediate_size, chosen by a router (weights renormalised
    # to sum to one when norm_topk_prob), plus a shared expert behind a sigmoid gate when
    # shared_expert_intermediate_size > 0 (qwen2_moe). Layers in dense_layers keep a plain MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    # Expert parallelism: this rank of how many, and the experts it owns, whole (num_experts stays
    # the router's width).
    expert_rank: int = 0
    expert_ranks: int = 1
    expert_offset: int = 0
    num_local_experts: int | None = None  # None: all of them
    # How the ranks' experts get their tokens: every rank routes every token and the layer's
    # all-reduce sums the experts' outputs, or each rank routes its own share of the tokens and
    # trades them with the experts' ranks by all-to-all (models/moe_dispatch.py).
    expert_all_to_all: bool = False
    # How the checkpoint says its embeddings pool, "mean" or "last" (models/pooling_config.py);
    # None where it names neither.
    pooling: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """A config stored as JSON (dataclasses.asdict), as it was."""
        raw = {**raw, "rope_scaling": RopeScaling(**raw["rope_scaling"])}
        for name in ("rope_freq_factors", "dense_layers"):
            if raw.get(name) is not None:
                raw[name] = tuple(raw[name])
        return cls(**raw)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs and cfg.get("model_type") in SUPPORTED_ARCHITECTURES.values():
            arch = cfg["model_type"]  # a config.json written without its model's class names
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"shoal supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers v5 writes rope settings under rope_parameters; older files use rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {**legacy, **rope}
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        # qwen2_moe names its q/k/v bias qkv_bias (on by default); the others attention_bias.
        bias = cfg.get("qkv_bias", True) if arch == "qwen2_moe" else cfg.get("attention_bias", False)
        sliding = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=RopeScaling(
                rope_type=rope_type,
                factor=float(scaling.get("factor", 1.0)),
                low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
            ),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(bias),
            qk_norm=arch in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_per_head=arch != "olmoe",
            clip_qkv=cfg.get("clip_qkv"),
            sliding_window=sliding,
            **_moe_fields(arch, cfg),
        )


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of an HF config (none for a dense architecture)."""
    # transformers has named the expert count both ways, in one model's history or another's.
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if arch in ("mixtral", "olmoe"):  # every layer sparse; intermediate_size is an expert's
        return dict(
            num_experts=experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=arch == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        )
    if arch in ("qwen2_moe", "qwen3_moe"):
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = {i for i in range(cfg["num_hidden_layers"]) if (i + 1) % step}
        return dict(
            num_experts=experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=tuple(sorted(dense | set(cfg.get("mlp_only_layers") or ()))),
        )
    return {}
