"""`shoal index build`: documents from JSONL (`id`, `text`, `metadata`, and a `vector` where the
caller embedded them), embedded where they come without one, dealt into shards by a hash of their
id, each shard's index trained, filled and written to its folder (see shard.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from shoal.retrieval.shard import IndexShard, IndexSpec

EMBED_BATCH = 64


@dataclass
class BuildConfig:
    input: str = ""
    out: str = ""
    shards: int = 1
    spec: IndexSpec | None = None
    embed_url: str | None = None  # an OpenAI /v1/embeddings server (shoal's, a gateway's) for texts
    embed_model: str | None = None  # the model id sent there, or the checkpoint embedded in-process
    api_key: str | None = None
    pooling: str = "last"  # in-process only; a server pools as it is told to


def read_documents(path: Path) -> Iterator[dict]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
            if not isinstance(doc, dict) or "id" not in doc or not ("text" in doc or "vector" in doc):
                raise ValueError(f"{path}:{n}: a document needs an id, and a text or a vector")
            yield doc


def shard_of(doc_id, shards: int) -> int:
    """A stable home for a document: the same id lands on the same shard in every build."""
    digest = hashlib.blake2b(str(doc_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % shards


def http_embedder(url: str, model: str | None, api_key: str | None) -> Callable[[list[str]], np.ndarray]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def embed(texts: list[str]) -> np.ndarray:
        r = httpx.post(
            url.rstrip("/") + "/v1/embeddings",
            json={"model": model or "default", "input": texts},
            headers=headers,
            timeout=300,
        )
        if r.status_code != 200:
            raise RuntimeError(f"embedding failed (HTTP {r.status_code}): {r.text[:300]}")
        data = sorted(r.json()["data"], key=lambda d: d["index"])
        return np.asarray([d["embedding"] for d in data], dtype=np.float32)

    return embed


def local_embedder(model: str | None, pooling: str) -> Callable[[list[str]], np.ndarray]:
    from shoal.llm import LLM

    llm = LLM(model)

    def embed(texts: list[str]) -> np.ndarray:
        return np.asarray(llm.embed(texts, pooling), dtype=np.float32)

    return embed


def build_shards(cfg: BuildConfig, log: Callable[[str], None] = print) -> list[Path]:
    docs = list(read_documents(Path(cfg.input)))
    if not docs:
        raise ValueError(f"{cfg.input} has no documents")
    vectors = _vectors(docs, cfg, log)
    out = Path(cfg.out)
    homes = [shard_of(d["id"], cfg.shards) for d in docs]
    folders = []
    for s in range(cfg.shards):
        rows = [i for i, h in enumerate(homes) if h == s]
        if not rows:
            raise ValueError(f"shard {s} of {cfg.shards} would be empty: fewer shards for this data")
        kept = [{k: docs[i][k] for k in ("id", "text", "metadata") if k in docs[i]} for i in rows]
        shard = IndexShard.build(vectors[rows], kept, cfg.spec or IndexSpec(), name=f"shard-{s}")
        folder = out / f"shard-{s}"
        shard.save(folder, vectors[rows])
        kind = shard.spec.factory(shard.dim, shard.count)
        log(f"{folder}: {shard.count} vectors of width {shard.dim}, {kind}")
        folders.append(folder)
    return folders


def _vectors(docs: list[dict], cfg: BuildConfig, log: Callable[[str], None]) -> np.ndarray:
    missing = [i for i, d in enumerate(docs) if "vector" not in d]
    given = [i for i, d in enumerate(docs) if "vector" in d]
    width = len(docs[given[0]]["vector"]) if given else None
    out: dict[int, np.ndarray] = {i: np.asarray(docs[i]["vector"], dtype=np.float32) for i in given}
    if missing:
        embed = (
            http_embedder(cfg.embed_url, cfg.embed_model, cfg.api_key)
            if cfg.embed_url
            else local_embedder(cfg.embed_model, cfg.pooling)
        )
        for lo in range(0, len(missing), EMBED_BATCH):
            batch = missing[lo : lo + EMBED_BATCH]
            for i, v in zip(batch, embed([docs[i]["text"] for i in batch])):
                out[i] = v
            log(f"embedded {min(lo + EMBED_BATCH, len(missing))} of {len(missing)} texts")
    widths = {len(v) for v in out.values()} | ({width} if width else set())
    if len(widths) != 1:
        raise ValueError(f"the vectors do not have one width: {sorted(widths)}")
    return np.stack([out[i] for i in range(len(docs))])
