"""The KV connector's worker side, beside the KV pools of one runner: loads K/V that arrived
from another engine into a request's blocks, saves a request's K/V out of them, and counts the
transfers it finished. Both run inside a step (or between steps, on the engine's thread), so a
transfer has finished when its call returns."""

from __future__ import annotations

import torch

from shoal.engine.kv_connector.packing import pack, token_slots, unpack

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class KVConnectorWorker:
    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.kv_caches: KVCaches = []
        self.num_loaded = 0  # transfers finished, each way
        self.num_saved = 0

    def register(self, kv_caches: KVCaches) -> None:
        """The pools (one (K, V) pair per layer) that loads and saves go to and come from."""
        self.kv_caches = kv_caches

    def load(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Writes packed K/V ([layers, 2, tokens, kv_heads, head_dim]) into a request's first slots."""
        unpack(self.kv_caches, token_slots(block_ids, data.shape[2], self.block_size, self.device), data)
        self.num_loaded += 1

    def save(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The K/V of a request's first num_tokens tokens, packed."""
        data = pack(self.kv_caches, token_slots(block_ids, num_tokens, self.block_size, self.device))
        self.num_saved += 1
        return data

    def finished_transfers(self) -> tuple[int, int]:
        """(loaded, saved) since the runner started."""
        return self.num_loaded, self.num_saved
