"""Expert load balancing under expert parallelism (issue 30, after DeepSeek's EPLB): the engine
counts the tokens its router sends each expert over a window of steps; when the ranks' loads (the
tokens their experts take) are uneven, it replicates the hottest experts into spare slots on the
least loaded ranks, and a replicated expert's tokens are split between its holders. The new
placement rides with the next step to every rank (SchedulerOutput.expert_placement), which copies
the replicas' weights from their owners before the step runs: no request waits or is dropped."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.engine.config import ParallelConfig
from shoal.models.config import ModelConfig
from shoal.models.moe import expert_owners

Placement = dict[int, list[int]]  # expert -> the ranks holding it, its owner first


def rank_loads(counts: list[int], holders: Placement, ranks: int) -> list[float]:
    """Tokens each rank computes: an expert's tokens split evenly among its holders."""
    owners = expert_owners(len(counts), ranks)
    load = [0.0] * ranks
    for e, n in enumerate(counts):
        held = holders.get(e, [owners[e]])
        for r in held:
            load[r] += n / len(held)
    return load


def imbalance(load: list[float]) -> float:
    """max over mean (1: even)."""
    mean = sum(load) / len(load)
    return max(load) / mean if mean else 1.0


def plan_replicas(counts: list[int], ranks: int, spares: int) -> Placement:
    """Replicas for up to `spares` experts a rank, greedily: the expert with the most tokens per
    holder gets one more, on the least loaded rank that has a free slot and lacks it, while that
    lowers the most loaded rank's load."""
    owners = expert_owners(len(counts), ranks)
    holders: Placement = {}
    free = [spares] * ranks
    while True:
        load = rank_loads(counts, holders, ranks)
        hottest = max(range(len(counts)), key=lambda e: counts[e] / len(holders.get(e, [owners[e]])))
        held = holders.get(hottest, [owners[hottest]])
        room = [r for r in range(ranks) if free[r] and r not in held]
        if not room or counts[hottest] == 0:
            return holders
        target = min(room, key=lambda r: load[r])
        trial = {**holders, hottest: [*held, target]}
        if max(rank_loads(counts, trial, ranks)) >= max(load):
            return holders
        holders, free[target] = trial, free[target] - 1


@dataclass(frozen=True)
class BalanceStats:
    imbalance: float | None  # the last window's max/mean rank load, as its experts were placed
    rebalances: int


class ExpertBalancer:
    """Watches the experts' load and decides placements (the scheduler hands them to the ranks)."""

    @classmethod
    def for_model(cls, cfg: ModelConfig, parallel: ParallelConfig) -> ExpertBalancer | None:
        """One for a mixture of experts split over ranks (None otherwise)."""
        if not cfg.num_experts or parallel.expert_parallel_size < 2:
            return None  # (tensor parallelism inside experts gives every rank every expert)
        return cls(
            parallel.tensor_parallel_size, parallel.expert_spare_slots, parallel.expert_rebalance_steps
        )

    def __init__(self, ranks: int, spares: int, window_steps: int, threshold: float = 1.1):
        self.ranks = ranks
        self.spares = spares
        self.window_steps = window_steps
        self.threshold = threshold  # rebalance when a window's max/mean rank load exceeds this
        self.placement: dict[int, Placement] = {}  # layer -> its replicated experts
        self.last_imbalance: float | None = None  # of the last window, as its experts were placed
        self.rebalances = 0
        self._pending: dict[int, Placement] | None = None
        self._baseline: dict[int, list[int]] = {}
        self._steps = 0

    def observe(self, load: dict[int, list[int]] | None) -> None:
        """The experts' token counts so far (by layer), after a step."""
        self._steps += 1
        if load is None or self._steps < self.window_steps:
            return
        window = {
            layer: [n - b for n, b in zip(counts, self._baseline.get(layer, [0] * len(counts)))]
            for layer, counts in load.items()
        }
        self._baseline, self._steps = load, 0
        per_rank = [0.0] * self.ranks
        for layer, counts in window.items():
            for r, n in enumerate(rank_loads(counts, self.placement.get(layer, {}), self.ranks)):
                per_rank[r] += n
        self.last_imbalance = imbalance(per_rank)
        if self.spares and self.last_imbalance > self.threshold:
            plan = {layer: plan_replicas(counts, self.ranks, self.spares) for layer, counts in window.items()}
            if plan != self.placement:
                self.placement = self._pending = plan
                self.rebalances += 1

    def snapshot(self) -> BalanceStats:
        return BalanceStats(self.last_imbalance, self.rebalances)

    def take_placement(self) -> dict[int, Placement] | None:
        """A new placement for the next step to carry to the ranks, once."""
        pending, self._pending = self._pending, None
        return pending
