"""Decode steps on CUDA replayed from captured CUDA graphs.

A decode step of a small model is a few hundred small kernels; launched one by one from Python,
the GPU idles between them (measured on an H100: 12-20 ms per step of SmolLM2-135M, about 1% of
what reading its weights at HBM bandwidth takes). Captured once per padded batch size, the whole
forward replays in one launch. Inputs go through static buffers; padded rows write their K/V to a
slot no sequence owns and attend to it alone. Attention runs in the paged Triton kernel, whose
launch shape does not depend on context lengths.
"""

from __future__ import annotations

import logging
import time

import torch

from shoal.engine.attention import AttentionMetadata
from shoal.kernels.triton_attention import paged_decode_attention
from shoal.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def capture_sizes(max_rows: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64, then every 32."""
    sizes = [s for s in (1, 2, 4) if s < max_rows]
    s = 8
    while s < max_rows:
        sizes.append(s)
        s += 8 if s < 64 else 32
    return [*sizes, max_rows]


class CudaGraphDecoder:
    """Replays decode-only steps of up to `max_rows` rows; other steps run the model eagerly."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_rows: int,
        max_blocks: int,
        pad_slot: int,
    ):
        cfg = model.cfg
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.window = cfg.sliding_window
        self.scale = cfg.head_dim**-0.5
        self.pad_slot = pad_slot
        dev = kv_caches[0][0].device
        self.max_blocks = max_blocks
        # A step's inputs go in one copy: for a padded size s, [ids | positions | slots | lens] of
        # s each, then the s rows of block tables, written here in pinned host memory and sent to
        # the same layout on the device, which each size's graph reads through its own views.
        span = max_rows * (4 + max_blocks)
        self.staged = torch.zeros(span, dtype=torch.long, pin_memory=True)
        self.inputs = torch.zeros(span, dtype=torch.long, device=dev)
        self.sent = torch.cuda.Event()  # the last copy out of `staged` has been read
        self.sizes = capture_sizes(max_rows)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self.graphs[size] = self._capture(size, pool)
        log.info(
            "captured %d CUDA graphs (batch 1 to %d) in %.1f s",
            len(self.sizes),
            max_rows,
            time.perf_counter() - t0,
        )

    def _views(self, buf: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        """ids, positions, slots, context lengths [size] and block tables [size, max_blocks]."""
        ids, positions, slots, lens = buf[: 4 * size].view(4, size)
        return ids, positions, slots, lens, buf[4 * size : size * (4 + self.max_blocks)].view(size, -1)

    def _pad(self, views: tuple[torch.Tensor, ...], start: int) -> None:
        """Rows from `start` on: padding, each with its own slot and a context of one. (Every field
        is set: the buffers hold other sizes' layouts from earlier steps.)"""
        ids, positions, slots, lens, tables = views
        ids[start:].fill_(0)
        positions[start:].fill_(0)
        slots[start:].fill_(self.pad_slot)
        lens[start:].fill_(1)
        tables[start:, 0].fill_(self.pad_slot // self.block_size)

    def _attend(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor):
        def attend(layer: int, q, k, v):
            k_cache, v_cache = self.kv_caches[layer]
            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                tables,
                lens,
                self.block_size,
                self.window,
                self.scale,
                new_kv=(k, v, slots),
            )

        return attend

    @torch.inference_mode()
    def _capture(self, rows: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, positions, slots, lens, tables = views = self._views(self.inputs, rows)
        self._pad(views, 0)
        run = lambda: self.model(ids, positions, self._attend(slots, tables, lens))  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph: lazy initialisation, kernel compilation
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = run()
        return graph, hidden

    def takes_step(self, rows: int, has_prefills: bool) -> bool:
        """Whether a step is one the captured graphs replay: decode rows only, up to the largest."""
        return not has_prefills and rows <= self.sizes[-1]

    def handles(self, md: AttentionMetadata) -> bool:
        return md.token_batch is not None

    def forward(
        self, input_ids: torch.Tensor, positions_in: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """One decode step from its inputs on the host (the runner leaves them there for a fast
        path): they are staged and sent in one copy, then the step's size of graph replays. The
        input ids may instead be on the device (the tokens of the step queued before this one)."""
        batch = md.token_batch
        rows = batch.rows
        size = next(s for s in self.sizes if s >= rows)
        width = batch.block_tables.shape[1]
        self.sent.synchronize()
        ids, positions, slots, lens, tables = views = self._views(self.staged, size)
        on_device = input_ids.device.type == "cuda"  # the last step's tokens, not yet read
        if not on_device:
            ids[:rows] = input_ids
        positions[:rows] = positions_in
        slots[:rows] = md.slot_mapping
        lens[:rows] = batch.context_lens
        tables[:rows, :width] = batch.block_tables
        if size > rows:
            self._pad(views, rows)
        span = size * (4 + self.max_blocks)
        self.inputs[:span].copy_(self.staged[:span], non_blocking=True)
        self.sent.record()
        if on_device:
            self.inputs[:rows].copy_(input_ids)
        graph, hidden = self.graphs[size]
        graph.replay()
        self.replays += 1
        return hidden[:rows]
