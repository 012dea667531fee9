"""Loads HF checkpoints: config.json plus one or many safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from shoal.models.config import ModelConfig
from shoal.models.parallel import ModelShard
from shoal.models.pooling_config import hf_dir_pooling
from shoal.models.sharded_read import read_slice


def load_hf_config(model_dir: Path) -> ModelConfig:
    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    return replace(cfg, pooling=hf_dir_pooling(model_dir))


def iter_hf_weights(
    model_dir: Path, dtype: torch.dtype, shard: ModelShard | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by HF name; with `shard`, only that rank's slices of its tensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {model_dir}")
    for name in files:
        with safe_open(model_dir / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if shard is None:
                    yield key, f.get_tensor(key).to(dtype)
                elif shard.local_name(key) is not None:
                    yield key, read_slice(f, key, shard).to(dtype)
