"""Replicas, their gateway and their clients on one host's few cores.

A fleet tested on one machine pins each replica to cores of its own, and the gateway (which relays
every token) and the clients float over the same cores. The profile's serving calibration ran one
replica with the rest of the host free, so the front's work ran beside it, not in its way; with
every core held by a replica's compute threads, it is taken from their steps (without this rule
the simulator predicted two one-core replicas on this 2-core host 30-35 % too fast at ITL p50;
with it, within 6 %: README, issue 31). The rule: the front needs `front_cpu_s_per_token` CPU
seconds a token streamed, at the rate tokens went out over the last window; what the cores left
idle by the replicas computing cannot hold is taken evenly from their threads, and their steps
stretch by as much, less what the calibration's own placement already paid.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 1.0  # the recent past whose token rate sets the front's demand
MAX_STOLEN = 0.8  # the front never takes more than this part of a replica's threads


@dataclass
class SharedCores:
    cores: int  # the host's cores that the replicas, the gateway and the clients all run on
    threads: int  # cores each replica's compute threads are pinned to
    front_cpu_s_per_token: float  # CPU seconds of the gateway and clients for each token streamed
    # Cores the calibration left to the front: the host's, less one replica's (it ran alone).
    calibrated_free: float
    _sent: deque = field(default_factory=deque)  # (time, tokens) streamed within the window
    _in_window: int = 0

    def streamed(self, now: float, tokens: int) -> None:
        if tokens:
            self._sent.append((now, tokens))
            self._in_window += tokens

    def demand(self, now: float) -> float:
        """Cores the front needs now, from the tokens streamed in the last WINDOW_S."""
        while self._sent and self._sent[0][0] <= now - WINDOW_S:
            self._in_window -= self._sent.popleft()[1]
        return self.front_cpu_s_per_token * self._in_window / WINDOW_S

    def stretch(self, now: float, computing: int) -> float:
        """What a step's cost is multiplied by when it starts now with `computing` replicas (it
        among them) holding their cores."""
        demand = self.demand(now)
        busy = max(1, computing) * self.threads
        taken = min(MAX_STOLEN, max(0.0, demand - max(0, self.cores - busy)) / busy)
        taken_in_calibration = min(MAX_STOLEN, max(0.0, demand - self.calibrated_free) / self.threads)
        return max(1.0, (1 - taken_in_calibration) / (1 - taken))
