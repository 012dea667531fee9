"""What a fleet's front costs a replica that shares its core: measured by a calibration run with the
gateway and the client pinned to the replica's own cores, and read as the factor on the front's CPU
time (SharedCores.front_cost) that makes the simulator give that run's mean inter-token time.

A front that wakes on a compute core for every token preempts the step and evicts its caches: on
this 2-core host, one 1-thread replica at 1.5 req/s had an inter-token mean 20-34 % longer with its
gateway and client pinned to its core than with them on the other one, for 8 % of a core of front
CPU (README, issue 31)."""

from __future__ import annotations

import contextlib
import os

from shoal.sim.fleet import FleetShape, FleetSim
from shoal.sim.profile import NodeProfile
from shoal.sim.replica import ReplicaShape
from shoal.sim.workload import Lengths, WorkloadSpec

MAX_FRONT_COST = 8.0  # past this, a pinned run says more about the host than about the front


@contextlib.contextmanager
def front_pinned_to(cores: set[int], gateway_pid: int):
    """Pins every thread of the gateway's process, and this thread (the client's), to `cores`
    while the block runs, then puts their affinities back."""
    import psutil

    threads = [t.id for t in psutil.Process(gateway_pid).threads()] + [0]
    before = {tid: os.sched_getaffinity(tid) for tid in threads}
    try:
        for tid in threads:
            os.sched_setaffinity(tid, cores)
        yield
    finally:
        for tid, mask in before.items():
            with contextlib.suppress(OSError):  # a gateway thread that has ended
                os.sched_setaffinity(tid, mask)


def simulated_itl(
    profile: NodeProfile, requests: int, clients: int, prompt: int, steps: int, cost: float
) -> float:
    """The mean inter-token time of a calibration run with its front on the replica's cores (all
    the host the simulator sees), its front costing `cost` times its CPU."""
    spec = WorkloadSpec(requests, input_len=Lengths("fixed", prompt), output_len=Lengths("fixed", steps))
    replica = ReplicaShape(profile.max_num_seqs, profile.max_num_batched_tokens, 0.0)
    threads = profile.num_threads or int(profile.serving["cores"])
    sim = FleetSim(profile, FleetShape(1, replica=replica, max_concurrency=clients, shared_cores=threads))
    sim.cores.front_cost = cost
    return sim.run(spec.requests()).summary()["itl_s"]["mean"]


def fit_front_cost(profile: NodeProfile, run: tuple[int, int, int, int], measured_itl: float) -> float:
    """The front cost at which the simulator gives `measured_itl` for `run` (requests, clients,
    prompt, steps) pinned; 1 where the pinned run was no slower than its front's CPU explains, and
    at most MAX_FRONT_COST. The simulated time grows with the cost, so a bisection finds it."""
    if simulated_itl(profile, *run, cost=1.0) >= measured_itl:
        return 1.0
    if simulated_itl(profile, *run, cost=MAX_FRONT_COST) <= measured_itl:
        return MAX_FRONT_COST
    low, high = 1.0, MAX_FRONT_COST
    for _ in range(20):
        mid = (low + high) / 2
        low, high = (mid, high) if simulated_itl(profile, *run, cost=mid) < measured_itl else (low, mid)
    return (low + high) / 2
