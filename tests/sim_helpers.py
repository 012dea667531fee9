"""Workloads and readers shared by the simulator's tests."""

from __future__ import annotations

from shoal.sim.fleet import SimResult
from shoal.sim.workload import Burst, Lengths, SimRequest, WorkloadSpec


def burst_requests(seed: int = 4) -> list[SimRequest]:
    """1 request a second for 10 s, then 30 a second for 5 s, then 1 a second for 20 s."""
    spec = WorkloadSpec(
        num_requests=10 + 150 + 20,
        rate=1.0,
        bursts=[Burst(10.0, 5.0, 30.0)],
        input_len=Lengths("fixed", 256),
        output_len=Lengths("fixed", 64),
        seed=seed,
    )
    return spec.requests()


def first_tokens(result) -> list[tuple[float, float]]:
    """(sent, TTFT) of each request, by when it was sent, from either simulator's result."""
    if isinstance(result, SimResult):
        return sorted((r.start, r.ttft) for r in result.records)
    return sorted(zip(result.out.start, result.out.ttft, strict=True))
