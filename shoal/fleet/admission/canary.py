"""A rolling update's canary split: the canary's share of a model's requests goes to replicas of
the new version, the rest to the old (see control/rollout.py, which sets and clears it)."""

from __future__ import annotations

import random

from shoal.fleet.replicas.replica import Replica


class CanarySplit:
    def __init__(self):
        self.shares: dict[str | None, tuple[int, float]] = {}  # model -> (new version, its share)

    def start(self, model: str | None, version: int, share: float) -> None:
        self.shares[model] = (version, share)

    def stop(self, model: str | None) -> None:
        self.shares.pop(model, None)

    def split(self, model: str | None, free: list[Replica]) -> list[Replica]:
        if model not in self.shares:
            return free
        version, share = self.shares[model]
        new = [r for r in free if r.version == version]
        old = [r for r in free if r.version != version]
        if not new or not old:
            return free
        return new if random.random() < share else old
