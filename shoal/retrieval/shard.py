"""One shard of a vector index: a faiss index over unit vectors (inner product: cosine), the
documents beside it (id, text, metadata, in the index's own order), and the files it is kept in.

A shard's folder: `index.faiss` (faiss's own format), `docs.jsonl` (a document a line),
`vectors.npy` (the vectors as added, for recall probes: read from disk, never held), and
`shard.json` (what kind of index, its width and size, how it was built)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from shoal.retrieval import faiss_lib

KINDS = ("flat", "ivfpq", "hnsw")
TRAIN_POINTS_PER_LIST = 64
FORMAT_VERSION = 1


@dataclass
class IndexSpec:
    """How an index is built. ivfpq: `nlist` inverted lists, vectors coded in `pq_m` sub-vectors of
    8 bits, and (refine) the best `refine` x k candidates re-ranked exactly; hnsw: a graph of
    `hnsw_m` links per node, built with `ef_construction`. 0 lets the size of the data decide."""

    kind: str = "hnsw"
    nlist: int = 0
    pq_m: int = 0
    refine: bool = True
    hnsw_m: int = 32
    ef_construction: int = 80

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"index kind must be one of {', '.join(KINDS)}, not {self.kind!r}")

    def factory(self, dim: int, count: int) -> str:
        """faiss's index_factory string for `count` vectors of width `dim`."""
        if self.kind == "flat":
            return "Flat"
        if self.kind == "hnsw":
            return f"HNSW{self.hnsw_m},Flat"
        nlist = self.nlist or max(1, min(int(count**0.5), count // 39))  # >= 39 points a list
        m = self.pq_m or _pq_m(dim)
        return f"IVF{nlist},PQ{m}x8" + (",RFlat" if self.refine else "")


def _nlist(index) -> int:
    faiss = faiss_lib()
    base = faiss.downcast_index(index.base_index) if hasattr(index, "base_index") else index
    return faiss.extract_index_ivf(base).nlist


def _pq_m(dim: int) -> int:
    """Sub-vectors of about 4 dimensions each (a byte per 4 floats: 16x smaller), a divisor of
    the width. Coarser codes lose more recall than refine wins back (measured at width 64)."""
    for m in range(max(1, dim // 4), 0, -1):
        if dim % m == 0:
            return m
    return 1


@dataclass
class SearchParams:
    """Per query: IVF lists probed, HNSW candidates kept, refine's candidates per result."""

    nprobe: int = 16
    ef_search: int = 64
    k_factor: int = 8


@dataclass
class Hit:
    id: str
    score: float
    text: str | None = None
    metadata: dict = field(default_factory=dict)


class IndexShard:
    def __init__(self, index, docs: list[dict], spec: IndexSpec, name: str = "shard-0"):
        self.index = index
        self.docs = docs  # the document of each of the index's vectors, in order
        self.spec = spec
        self.name = name
        self.vectors_path: Path | None = None

    @property
    def dim(self) -> int:
        return self.index.d

    @property
    def count(self) -> int:
        return self.index.ntotal

    @classmethod
    def build(
        cls, vectors: np.ndarray, docs: list[dict], spec: IndexSpec, name: str = "shard-0"
    ) -> IndexShard:
        faiss = faiss_lib()
        vectors = unit_rows(vectors)
        if len(docs) != len(vectors):
            raise ValueError(f"{len(docs)} documents for {len(vectors)} vectors")
        index = faiss.index_factory(
            vectors.shape[1], spec.factory(*vectors.shape[::-1]), faiss.METRIC_INNER_PRODUCT
        )
        if spec.kind == "hnsw":
            faiss.downcast_index(index).hnsw.efConstruction = spec.ef_construction
        if not index.is_trained:
            # k-means on a sample: 64 points a list train it as well as all of them would, and a
            # million vectors' training takes a minute instead of an hour.
            sample = vectors
            if len(vectors) > TRAIN_POINTS_PER_LIST * _nlist(index):
                rows = np.random.default_rng(0).choice(
                    len(vectors), TRAIN_POINTS_PER_LIST * _nlist(index), replace=False
                )
                sample = vectors[np.sort(rows)]
            index.train(sample)
        index.add(vectors)
        return cls(index, docs, spec, name)

    def search(self, queries: np.ndarray, k: int, params: SearchParams | None = None) -> list[list[Hit]]:
        """The `k` nearest documents of each query (unit vectors, inner product), best first."""
        faiss = faiss_lib()
        params = params or SearchParams()
        space = faiss.ParameterSpace()
        if self.spec.kind == "ivfpq":
            space.set_index_parameter(self.index, "nprobe", params.nprobe)
            if self.spec.refine:
                space.set_index_parameter(self.index, "k_factor_rf", params.k_factor)
        elif self.spec.kind == "hnsw":
            space.set_index_parameter(self.index, "efSearch", max(params.ef_search, k))
        scores, rows = self.index.search(unit_rows(queries), min(k, max(1, self.count)))
        return [
            [self._hit(int(r), float(s)) for r, s in zip(row_ids, row_scores) if r >= 0]
            for row_ids, row_scores in zip(rows, scores)
        ]

    def _hit(self, row: int, score: float) -> Hit:
        d = self.docs[row]
        return Hit(str(d["id"]), score, d.get("text"), d.get("metadata") or {})

    def exact(self, queries: np.ndarray, k: int) -> list[list[str]]:
        """The true `k` nearest ids by brute force over the stored vectors (recall probes)."""
        if self.vectors_path is None:
            raise ValueError("this shard keeps no vectors to search exactly")
        stored = np.load(self.vectors_path, mmap_mode="r")
        q = unit_rows(queries)
        best = []
        for lo in range(0, len(stored), 65536):  # a slice at a time: the file stays on disk
            scores = q @ np.asarray(stored[lo : lo + 65536]).T
            top = np.argsort(-scores, axis=1)[:, :k] + lo
            best.append((np.take_along_axis(scores, top - lo, axis=1), top))
        scores = np.concatenate([s for s, _ in best], axis=1)
        rows = np.concatenate([r for _, r in best], axis=1)
        order = np.argsort(-scores, axis=1)[:, :k]
        return [
            [str(self.docs[int(r)]["id"]) for r in np.take_along_axis(rows, order, axis=1)[i]]
            for i in range(len(q))
        ]

    # --- files ---------------------------------------------------------------------------

    def save(self, folder: Path, vectors: np.ndarray | None = None) -> None:
        """Writes the shard's files (each whole, then renamed into place)."""
        faiss = faiss_lib()
        folder.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self.index, str(folder / "index.faiss.part"))
        (folder / "index.faiss.part").replace(folder / "index.faiss")
        with open(folder / "docs.jsonl.part", "w") as f:
            for d in self.docs:
                f.write(json.dumps(d) + "\n")
        (folder / "docs.jsonl.part").replace(folder / "docs.jsonl")
        if vectors is not None:
            with open(folder / "vectors.npy.part", "wb") as f:
                np.save(f, unit_rows(vectors))
            (folder / "vectors.npy.part").replace(folder / "vectors.npy")
            self.vectors_path = folder / "vectors.npy"
        meta = {"version": FORMAT_VERSION, "name": self.name, "dim": self.dim, "count": self.count}
        meta |= {"factory": self.spec.factory(self.dim, self.count), "spec": asdict(self.spec)}
        (folder / "shard.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, folder: Path) -> IndexShard:
        faiss = faiss_lib()
        meta = json.loads((folder / "shard.json").read_text())
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{folder}: shard format {meta.get('version')}, this shoal reads {FORMAT_VERSION}"
            )
        index = faiss.read_index(str(folder / "index.faiss"))
        with open(folder / "docs.jsonl") as f:
            docs = [json.loads(line) for line in f]
        if len(docs) != index.ntotal:
            raise ValueError(f"{folder}: {len(docs)} documents for {index.ntotal} vectors")
        shard = cls(index, docs, IndexSpec(**meta["spec"]), meta["name"])
        if (folder / "vectors.npy").exists():
            shard.vectors_path = folder / "vectors.npy"
        return shard


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length, as contiguous float32 (what faiss takes)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError("vectors must be a 2-D array, one row each")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.maximum(norms, 1e-12), dtype=np.float32)
