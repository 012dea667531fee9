"""Retrieval: vector index shards (faiss), the servers that hold them, the router that scatters a
query over them within a latency budget, and the grounding of chat answers in what it finds."""

from __future__ import annotations


def faiss_lib():
    """faiss, an optional dependency (`pip install 'shoal[retrieval]'`)."""
    try:
        import faiss
    except ImportError as exc:
        raise RuntimeError("retrieval needs faiss: pip install 'shoal[retrieval]' (faiss-cpu)") from exc
    return faiss
