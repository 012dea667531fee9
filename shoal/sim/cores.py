"""Replicas, their gateway and their clients on one host's few cores.

A fleet tested on one machine pins each replica to cores of its own, and the gateway (which relays
every token) and the clients float over the same cores. The profile's serving calibration ran one
replica with the rest of the host free, so the front's work ran beside it, not in its way; with
every core held by a replica's compute threads, it is taken from their steps (without this rule
the simulator predicted two one-core replicas on this 2-core host 35-36 % too fast at ITL p50;
with it, 5.6-6.1 %: README, issue 31). The rule: the front needs `front_cpu_s_per_token` CPU
seconds a token streamed, at the rate tokens went out over the last window, and the gateway
`front_idle_cores` for each replica it watches whether tokens flow or not (its polls of /load and
KV events: 43-48 ms a second for one replica here; counted into the token's price, it made a
burst's steps pay more than twice the front's CPU a token). What the cores left
idle by the replicas computing cannot hold is taken evenly from their threads. A replica's profile
already paid for what the front took from it in its calibration, alone with the calibration's
free cores at the rate of tokens each replica streams now; a step stretches by what is taken
beyond that.
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
    front_idle_cores: float = 0.0  # the gateway's CPU a second for each replica it watches
    # (time, replica, tokens) streamed within the window, and the window's tokens by replica
    _sent: deque = field(default_factory=deque)
    _in_window: dict[int, int] = field(default_factory=dict)

    def streamed(self, now: float, replica: int, tokens: int) -> None:
        if tokens:
            self._sent.append((now, replica, tokens))
            self._in_window[replica] = self._in_window.get(replica, 0) + tokens

    def _cores_needed(self, now: float, watched: int) -> tuple[float, float]:
        """Cores the front needs now for the fleet's tokens and its `watched` replicas, and for one
        streaming replica's (their mean: the front's work is taken evenly, so each pays as the
        average replica)."""
        while self._sent and self._sent[0][0] <= now - WINDOW_S:
            _, i, n = self._sent.popleft()
            self._in_window[i] -= n
            if not self._in_window[i]:
                del self._in_window[i]
        fleet = self.front_cpu_s_per_token * sum(self._in_window.values()) / WINDOW_S
        fleet += self.front_idle_cores * watched
        return fleet, fleet / max(1, len(self._in_window))

    def stretch(self, now: float, computing: int, watched: int = 1) -> float:
        """What a step's cost is multiplied by when it starts now with `computing` replicas (it
        among them) holding their cores, and the gateway watching `watched`."""
        fleet, each = self._cores_needed(now, watched)
        busy = max(1, computing) * self.threads
        taken = max(0.0, fleet - max(0, self.cores - busy)) / busy
        paid = max(0.0, each - self.calibrated_free) / self.threads
        return 1 / (1 - min(MAX_STOLEN, max(0.0, taken - paid)))
