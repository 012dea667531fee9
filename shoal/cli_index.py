"""`shoal index build` and `shoal index serve`: vector index shards (shoal/retrieval)."""

from __future__ import annotations

import sys

from shoal.cli_types import NON_NEGATIVE, PORT, whole
from shoal.protocol.secrets import api_key_from


def cmd_index_build(args) -> int:
    from shoal.retrieval.build import BuildConfig, build_shards
    from shoal.retrieval.shard import IndexSpec

    refine = not args.no_refine
    spec = IndexSpec(args.kind, nlist=args.nlist, pq_m=args.pq_m, refine=refine, hnsw_m=args.hnsw_m)
    cfg = BuildConfig(
        input=args.input,
        out=args.out,
        shards=args.shards,
        spec=spec,
        embed_url=args.embed_url,
        embed_model=args.embed_model,
        api_key=api_key_from(None),
        pooling=args.pooling,
    )
    try:
        build_shards(cfg)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_index_serve(args) -> int:
    from shoal.retrieval.server import IndexServerConfig, serve_index

    cfg = IndexServerConfig(
        folder=args.folder,
        host=args.host,
        port=args.port,
        api_key=api_key_from(args.api_key),
        recall_probe_interval_s=args.recall_probe_interval,
    )
    try:
        return serve_index(cfg)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2


def add_index_parsers(sub) -> None:
    index = sub.add_parser("index", help="vector index shards for retrieval (needs faiss)").add_subparsers(
        dest="index_command", required=True
    )
    p = index.add_parser("build", help="embed, train and fill index shards from JSONL documents")
    p.add_argument("--input", required=True, help='JSONL: {"id", "text", "metadata"} and/or "vector"')
    p.add_argument("--out", required=True, help="folder of the shards (shard-0, shard-1, ...)")
    p.add_argument("--shards", type=whole(1), default=1)
    p.add_argument("--kind", choices=("flat", "ivfpq", "hnsw"), default="hnsw")
    p.add_argument("--nlist", type=whole(0), default=0, help="ivfpq: inverted lists (default: from the size)")
    p.add_argument("--pq-m", type=whole(0), default=0, help="ivfpq: sub-vectors (default: width / 4)")
    p.add_argument("--no-refine", action="store_true", help="ivfpq: no exact re-ranking")
    p.add_argument("--hnsw-m", type=whole(2), default=32, help="hnsw: links per node")
    p.add_argument("--embed-url", default=None, help="an OpenAI /v1/embeddings server for the texts")
    p.add_argument("--embed-model", default=None, help="its model id; without --embed-url, a checkpoint")
    p.add_argument("--pooling", choices=("mean", "last"), default="last", help="in-process embedding")
    p.set_defaults(func=cmd_index_build)
    p = index.add_parser("serve", help="serve one shard over HTTP (POST /search)")
    p.add_argument("folder", help="a shard's folder, as `shoal index build` wrote it")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=8100)
    p.add_argument("--api-key", default=None, help="require it on /search and /info (default $SHOAL_API_KEY)")
    p.add_argument("--recall-probe-interval", type=NON_NEGATIVE, default=0.0, help="seconds; 0: no probes")
    p.set_defaults(func=cmd_index_serve)
