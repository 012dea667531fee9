"""The log of KV-cache events that the fleet's router polls to learn which blocks are cached here.

Events get sequence numbers as they are appended; a poller asks for those after the last it saw.
The log is bounded: a poller that falls further behind than it holds is told to `reset` (drop its
index of this replica and rebuild it from what follows). The instance id changes with every
process, so a router also drops its index of a replica that restarted."""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque

from shoal.engine.block_pool import KVEvent


class KVEventLog:
    def __init__(self, max_events: int, block_size: int):
        self.block_size = block_size
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.Lock()  # appended on the engine thread, read on the event loop
        self._log: deque[tuple[int, KVEvent]] = deque(maxlen=max_events)
        self._seq = 0

    def extend(self, events: list[KVEvent]) -> None:
        if not events:
            return
        with self._lock:
            for ev in events:
                self._seq += 1
                self._log.append((self._seq, ev))

    def since(self, after: int, limit: int = 20_000) -> dict:
        """Events with sequence numbers above `after`; `reset` when some were already dropped."""
        with self._lock:
            oldest = self._log[0][0] if self._log else self._seq + 1
            reset = after < oldest - 1
            skip = min(max(0, after + 1 - oldest), len(self._log))
            picked = list(itertools.islice(self._log, skip, skip + limit))
            last = picked[-1][0] if picked else max(after, self._seq)
        return {
            "instance": self.instance_id,
            "block_size": self.block_size,
            "reset": reset,
            "next": last,
            "events": [
                {"kind": ev.kind, "block_hash": ev.block_hash, "parent_hash": ev.parent_hash}
                for _, ev in picked
            ],
        }
