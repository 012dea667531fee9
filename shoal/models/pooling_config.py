"""How a checkpoint says its embeddings pool: sentence-transformers' `1_Pooling/config.json`
beside an HF checkpoint, or a GGUF file's `{arch}.pooling_type`. Read with the checkpoint's config
(ModelConfig.pooling), so that a start never walks a GGUF's metadata a second time."""

from __future__ import annotations

import json
from pathlib import Path

# llama.cpp's pooling types: 0 none, 1 mean, 2 cls, 3 last, 4 rank. shoal pools by mean or last.
_GGUF_POOLING = {1: "mean", 3: "last"}
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def gguf_pooling(kind) -> str | None:
    """ "mean" or "last" for a GGUF `pooling_type` value that names one of them, else None."""
    return None if kind is None else _GGUF_POOLING.get(int(kind))


def hf_dir_pooling(model_dir: Path) -> str | None:
    """ "mean" or "last" where sentence-transformers' pooling config beside the weights names one
    of them; None where it names none or is absent."""
    found = model_dir / "1_Pooling" / "config.json"
    if not found.exists():
        return None
    cfg = json.loads(found.read_text())
    return next((mode for key, mode in _ST_POOLING.items() if cfg.get(key)), None)
