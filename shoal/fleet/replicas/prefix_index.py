"""Which replica holds which KV blocks, for prefix-aware routing.

Replicas that publish KV events keep their entry exact (stored / removed). For any replica the
gateway also records the blocks of prompts it routed there, which stands in for events on foreign
backends and covers the moment before a replica's own events arrive. Each replica's entry is an
LRU of bounded size, so guesses that were never confirmed age out.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_blocks_per_replica: int = 200_000):
        self.max_blocks = max_blocks_per_replica
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def _entry(self, replica: str) -> OrderedDict[int, None]:
        return self._blocks.setdefault(replica, OrderedDict())

    def _add(self, replica: str, block_hash: int) -> None:
        entry = self._entry(replica)
        entry[block_hash] = None
        entry.move_to_end(block_hash)
        if len(entry) > self.max_blocks:
            entry.popitem(last=False)

    def stored(self, replica: str, block_hash: int) -> None:
        self._add(replica, block_hash)

    def removed(self, replica: str, block_hash: int) -> None:
        self._entry(replica).pop(block_hash, None)

    def routed(self, replica: str, hashes: list[int]) -> None:
        for h in hashes:
            self._add(replica, h)

    def reset(self, replica: str) -> None:
        self._blocks.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    def matched_blocks(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        """For each replica, how many leading blocks of the prompt it holds."""
        out = {}
        for name in replicas:
            entry = self._blocks.get(name)
            n = 0
            if entry:
                for h in hashes:
                    if h not in entry:
                        break
                    n += 1
            out[name] = n
        return out
