"""A cache of GGUF checkpoints in the form shoal loads fastest: safetensors weights (already
dequantised and un-permuted), the quantized blocks that the int4 path runs as stored, config and
tokenizer as JSON.

Reading a GGUF costs seconds here: gguf-py walks every vocabulary string through numpy memmaps and
dequantises in numpy. The first load of a file writes the cache; later loads read it back in a
fraction of that. Keyed by path, size, mtime and dtype; a new entry removes the one it replaces
(the file changed, or shoal's cache format did). Set SHOAL_CACHE_DIR to move it, or
SHOAL_NO_CACHE=1 to turn it off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from shoal.cache_dir import cache_root
from shoal.models.config import ModelConfig
from shoal.models.parallel import ModelShard
from shoal.models.quant import BlockWeights
from shoal.models.sharded_read import read_block_part, read_slice
from shoal.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = 4  # 4: the config holds the checkpoint's pooling
SOURCE_FILE = "source.json"  # what an entry was converted from (the file's path, the dtype), in which format
PARTIAL_STALE_S = 3600.0


def _entry(path: Path, dtype: torch.dtype) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    st = path.stat()
    key = f"{CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}"
    return root / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


@dataclasses.dataclass
class CachedModel:
    config: ModelConfig
    tokenizer: Tokenizer
    entry: Path

    def weights(
        self, shard: ModelShard | None = None, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The float weights; with `shard`, only that rank's slices of the tensors on its stage;
        none whose (rank's) name is in `skip`, unread."""
        shard = shard or ModelShard(self.config)
        with safe_open(str(self.entry / "model.safetensors"), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                local = shard.local_name(name)
                if local is not None and local not in skip:
                    yield name, read_slice(f, name, shard)

    def block_formats(self) -> dict[str, str]:
        """Block format by tensor name, without reading the blocks."""
        return json.loads((self.entry / "blocks.json").read_text())

    def blocks(self, shard: ModelShard | None = None) -> dict[str, BlockWeights]:
        """The stored quantized blocks; with `shard`, that rank's slices, cut on block boundaries."""
        shard = shard or ModelShard(self.config)
        formats = {n: fmt for n, fmt in self.block_formats().items() if shard.local_name(n) is not None}
        if not formats:  # safetensors cannot read back a file of no tensors
            return {}
        with safe_open(str(self.entry / "blocks.safetensors"), framework="pt") as f:

            def part(name: str, fmt: str, p: str) -> torch.Tensor:
                return read_block_part(f, f"{name}.{p}", p, fmt, shard, name)

            return {
                name: BlockWeights(
                    fmt,
                    part(name, fmt, "qs"),
                    part(name, fmt, "d"),
                    part(name, fmt, "mn") if fmt == "q4_1" else None,
                )
                for name, fmt in formats.items()
            }


def load_cached(path: Path, dtype: torch.dtype) -> CachedModel | None:
    entry = _entry(path, dtype)
    if entry is None or not (entry / "blocks.json").exists():
        return None
    try:
        cfg = ModelConfig.from_dict(json.loads((entry / "config.json").read_text()))
        meta = json.loads((entry / "tokenizer_meta.json").read_text())
        tok = Tokenizer(
            HFTokenizer.from_file(str(entry / "tokenizer.json")),
            bos_token_id=meta["bos_token_id"],
            eos_token_ids=frozenset(meta["eos_token_ids"]),
            add_bos=meta["add_bos"],
            chat_template=meta["chat_template"],
            special_tokens=meta["special_tokens"],
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("dropping a broken cache entry %s: %s", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)  # so that this load can store a good one
        return None
    _prune(entry, path, dtype)  # what an older shoal left beside it
    return CachedModel(cfg, tok, entry)


def store(
    path: Path,
    dtype: torch.dtype,
    cfg: ModelConfig,
    tok: Tokenizer,
    weights: dict[str, torch.Tensor],
    blocks: dict[str, BlockWeights],
) -> None:
    """Writes the entry atomically (a temporary folder renamed into place); failures only warn."""
    entry = _entry(path, dtype)
    if entry is None:
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".partial-"))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
        block_tensors = {}
        for name, b in blocks.items():
            block_tensors[f"{name}.qs"], block_tensors[f"{name}.d"] = b.qs, b.d
            if b.mn is not None:
                block_tensors[f"{name}.mn"] = b.mn
        formats = {name: b.format for name, b in blocks.items()}
        if block_tensors:
            save_file(block_tensors, str(tmp / "blocks.safetensors"))
        (tmp / "blocks.json").write_text(json.dumps(formats))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        tok.backend.save(str(tmp / "tokenizer.json"))
        meta = {
            "bos_token_id": tok.bos_token_id,
            "eos_token_ids": sorted(tok.eos_token_ids),
            "add_bos": tok.add_bos,
            "chat_template": tok.chat_template,
            "special_tokens": tok.special_tokens,
        }
        (tmp / "tokenizer_meta.json").write_text(json.dumps(meta))
        (tmp / SOURCE_FILE).write_text(json.dumps(_source(path, dtype)))
        try:
            tmp.rename(entry)
        except OSError:  # another process stored it first
            shutil.rmtree(tmp, ignore_errors=True)
        _prune(entry, path, dtype)
    except OSError as exc:
        log.warning("could not cache %s: %s", path, exc)


def _source(path: Path, dtype: torch.dtype) -> dict:
    return {"path": str(path.resolve()), "dtype": str(dtype), "format": CACHE_FORMAT}


def _prune(kept: Path, path: Path, dtype: torch.dtype) -> None:
    """Removes the entries `kept` replaces: the same file and dtype at an older size, mtime or cache
    format (each as large as the model); an entry from before entries named their source, by the
    file's stem; and a partial write more than an hour old (its writer died). Failures only warn."""
    mine = {k: v for k, v in _source(path, dtype).items() if k != "format"}
    try:
        for other in kept.parent.iterdir():
            if other != kept and other.is_dir() and _replaced(other, mine, path.stem):
                log.info("removing %s, which %s replaces", other, kept.name)
                shutil.rmtree(other, ignore_errors=True)
    except OSError as exc:
        log.warning("could not tidy the cache beside %s: %s", kept, exc)


def _replaced(other: Path, mine: dict, stem: str) -> bool:
    if other.name.startswith(".partial-"):
        return time.time() - other.stat().st_mtime > PARTIAL_STALE_S
    if (other / SOURCE_FILE).exists():
        try:
            source = json.loads((other / SOURCE_FILE).read_text())
        except ValueError:
            return False
        return {k: source.get(k) for k in mine} == mine
    legacy = re.fullmatch(re.escape(stem) + r"-[0-9a-f]{20}", other.name)  # as _entry names them
    return legacy is not None and (other / "blocks.json").exists()
