"""Checkpoints in HF's layout with the bundled model's tokenizer and a shape of one's choosing, for
benchmarks that need a model of a given size rather than a given quality (random weights)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shoal.models.loader import load_model


def write_config(out: Path, **shape) -> Path:
    """config.json and tokenizer files of the bundled model (SmolLM2-135M), with `shape` (HF config
    keys such as hidden_size, num_hidden_layers) replacing its own."""
    loaded = load_model(quantization="none")
    cfg = loaded.config
    tok = loaded.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": sorted(tok.eos_token_ids)[0],
        "torch_dtype": "float32",
        **shape,
    }
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
    tok.backend.save(str(out / "tokenizer.json"))
    names = {
        "bos_token": tok.backend.id_to_token(tok.bos_token_id),
        "eos_token": tok.backend.id_to_token(sorted(tok.eos_token_ids)[0]),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(names))
    return out


def fill_random_weights(ckpt: Path, seed: int = 0, dtype: torch.dtype | None = None) -> Path:
    """Random weights for the config at `ckpt` (transformers' own init), unless it has some; stored
    as `dtype` where given (half the bytes to write and read for a large checkpoint)."""
    if (ckpt / "model.safetensors").exists():
        return ckpt
    import transformers  # a test dependency: only the benchmarks that write weights need it

    config = transformers.AutoConfig.from_pretrained(ckpt)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(ckpt, safe_serialization=True)
    return ckpt
