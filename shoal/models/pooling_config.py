"""How a checkpoint says its embeddings pool: sentence-transformers' `1_Pooling/config.json`
beside an HF checkpoint, or a GGUF file's `{arch}.pooling_type`."""

from __future__ import annotations

import json
from pathlib import Path

from gguf import GGUFReader

from shoal.models.gguf_meta import field_value

# llama.cpp's pooling types: 0 none, 1 mean, 2 cls, 3 last, 4 rank. shoal pools by mean or last.
_GGUF_POOLING = {1: "mean", 3: "last"}
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def checkpoint_pooling(path: Path) -> str | None:
    """ "mean" or "last" where the checkpoint names one of them; None where it names none."""
    if path.is_dir():
        found = path / "1_Pooling" / "config.json"
        if not found.exists():
            return None
        cfg = json.loads(found.read_text())
        return next((mode for key, mode in _ST_POOLING.items() if cfg.get(key)), None)
    if path.suffix != ".gguf":
        return None
    reader = GGUFReader(path)
    arch = field_value(reader, "general.architecture")
    kind = field_value(reader, f"{arch}.pooling_type")
    return _GGUF_POOLING.get(int(kind)) if kind is not None else None
