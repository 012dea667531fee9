"""Expert parallelism by all-to-all: each rank routes its own share of a step's tokens, sends every
(token, chosen expert) to the rank holding that expert, which runs it and sends the output back;
the home rank weighs and sums its tokens' outputs, and an all-gather gives every rank the whole
step again (attention, split by heads, needs every token on every rank).

Against the all-reduce dispatch (every rank routes every token, runs its experts on all of theirs,
and a sum over the ranks combines): the router and the shared expert run on a rank's share of the
tokens instead of all of them, and what crosses between ranks is the rows each expert takes
rather than the whole step's sum; the price is three collectives in place of one.
"""

from __future__ import annotations

import torch

from shoal.models.parallel import row_shares


class ExpertDispatch:
    """Trades a sparse layer's tokens with the ranks of their experts (`comm`: this rank's
    collectives among the `world` expert-parallel ranks)."""

    def __init__(self, comm, rank: int, world: int):
        self.comm, self.rank, self.world = comm, rank, world

    def __call__(self, moe, h: torch.Tensor) -> torch.Tensor:
        """The layer's output for the whole step [T, hidden], the same on every rank."""
        shares = row_shares(h.shape[0], self.world)
        mine = shares[self.rank]
        local = h[mine.start : mine.end]
        experts, weights = moe.route(local)
        num_experts = moe.gate.out_features
        chosen = experts.reshape(-1)
        token = torch.arange(local.shape[0], device=h.device).repeat_interleave(moe.top_k)
        # Sorted by destination, then expert: each rank receives its rows grouped by source and,
        # within a source, by expert, so the counts say which expert every received row is for.
        key = moe.destinations(chosen, token + mine.start) * num_experts + chosen
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.world * num_experts).view(self.world, num_experts)
        with moe.dispatching():
            every = self.comm.all_gather(counts)  # [source, destination, expert], alike on all ranks
            rows = every.sum(2)
            received = self.comm.all_to_all(local[token[order]], rows)
        moe.count(every.sum((0, 1)))
        per_source = every[:, self.rank]  # [source, expert]
        expert_of = torch.repeat_interleave(
            torch.arange(num_experts, device=h.device).repeat(self.world), per_source.reshape(-1)
        )
        outputs = moe.run_received(received, expert_of, per_source.sum(0))
        with moe.combining():
            back = self.comm.all_to_all(outputs, rows.t().contiguous())  # in the order they were sent
        out = torch.zeros_like(local)
        out.index_add_(0, token[order], back * weights.reshape(-1)[order].to(h.dtype).unsqueeze(1))
        moe.add_shared(local, out)
        largest = shares[0].size
        padded = torch.zeros((largest, h.shape[1]), dtype=h.dtype, device=h.device)
        padded[: out.shape[0]] = out
        with moe.combining():
            gathered = self.comm.all_gather(padded)
        return torch.cat([gathered[r, : s.size] for r, s in enumerate(shares)])
