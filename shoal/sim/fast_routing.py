"""The gateway's routing policies as the fast simulator (fast.py) runs them: over one role's
replicas that take requests now (a fleet's, an autoscaled pool's active ones, or a P/D fleet's
prefill or decode workers), with their loads in one flat list and the least loaded found through
a heap."""

from __future__ import annotations

import heapq
import itertools
import random

KV_CANDIDATES = 16  # holders of a prefix that kv_aware weighs against the least loaded replica


class FastRouter:
    """round_robin, power_of_two, least_load or kv_aware over `members` (indices into `loads`)."""

    def __init__(
        self,
        policy: str,
        members: list[int],
        loads: list[int],
        holders: dict[int, dict[int, None]],
        rng: random.Random,
        load_weight: float = 8.0,
    ):
        """`loads`: every replica's requests in its hands (the fleet's list, shared); `holders`:
        prefix id -> the members holding it, latest last (the members' own map)."""
        self.policy = policy
        self.members = members
        self.loads = loads
        self.holders = holders
        self.rng = rng
        self.load_weight = load_weight
        self._rr = 0
        self.serving = [False] * len(loads)
        self._heap: list[tuple[int, int]] = []  # lazy: stale entries skipped
        self.serve(members)

    def serve(self, members: list[int]) -> None:
        """From now on these take requests (an autoscaled pool's active replicas)."""
        for i in self.members:
            self.serving[i] = False
        for i in members:
            self.serving[i] = True
        self.members = members
        self._heap[:] = [(self.loads[i], i) for i in members]
        heapq.heapify(self._heap)

    def least_loaded(self) -> int:
        """The least loaded member, the lowest index of those: every change of a member's load
        pushes an entry, so the stale ones on top are dropped."""
        heap, loads, serving = self._heap, self.loads, self.serving
        while True:
            load, i = heap[0]
            if load == loads[i] and serving[i]:
                return i
            heapq.heappop(heap)

    def loaded(self, i: int) -> None:
        """Replica i's load changed."""
        if not self.serving[i]:
            return
        heap, loads = self._heap, self.loads
        heapq.heappush(heap, (loads[i], i))
        if len(heap) > 8 * len(self.members):  # stale entries of loads long gone: start afresh
            heap[:] = [(loads[j], j) for j in self.members]
            heapq.heapify(heap)

    def route(self, prefix_id: int | None, prefix_blocks: int, prompt_blocks: int) -> int:
        members, policy = self.members, self.policy
        n = len(members)
        if n == 1:
            return members[0]
        if policy == "round_robin":
            self._rr += 1
            return members[self._rr % n]
        if policy == "power_of_two":
            a, b = self.rng.sample(members, 2)
            return a if self.loads[a] <= self.loads[b] else b
        best = self.least_loaded()
        if policy != "kv_aware" or prefix_id is None:
            return best

        # kv_aware's cost: the prompt blocks a replica lacks + load_weight x its load. A replica
        # without the prefix is best at its least loaded, so only holders compete with that one;
        # of a prefix held widely, the latest few (a gateway over thousands of replicas that
        # scored each for every request would be its own bottleneck).
        holders = self.holders.get(prefix_id)
        if not holders:
            return best
        loads, w, serving = self.loads, self.load_weight, self.serving
        choice, low = best, prompt_blocks + w * loads[best]
        if best in holders:
            low -= prefix_blocks
        lacking = prompt_blocks - prefix_blocks
        for i in itertools.islice(reversed(holders), KV_CANDIDATES):
            c = lacking + w * loads[i]
            if c < low and serving[i]:
                choice, low = i, c
        return choice
