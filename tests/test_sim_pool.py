"""shoal/sim: autoscaled pools in simulated time, under the real Autoscaler's rules: a burst's
scale-up and the scale-down after it, cold and warm starts, a pool at zero, and both simulators
agreeing."""

from __future__ import annotations

import math
import random

import pytest

from shoal.fleet.control.autoscaler import AutoscaleConfig
from shoal.sim.fast import FastFleet
from shoal.sim.fleet import FleetShape, FleetSim
from shoal.sim.profile import made_up_profile
from shoal.sim.replica import ReplicaShape
from shoal.sim.scaling import STARTING, TICK_S, Load, ScalingShape, SimPool
from shoal.sim.workload import SimRequest, tokens
from tests.sim_helpers import burst_requests, first_tokens


@pytest.mark.parametrize("simulator", [FleetSim, FastFleet])
def test_an_autoscaled_pool_scales_up_for_a_burst_starts_cold_or_warm_and_scales_down(simulator):
    """The controller's rules in simulated time, with the real Autoscaler: a burst raises the
    pool (cold replicas take traffic after the start-up time, a warm standby at once), the pool
    shrinks after it, and replica-seconds count only the time replicas were up."""
    profile = made_up_profile()
    auto = AutoscaleConfig(target_inflight=4, scale_up_delay_s=0.5, scale_down_delay_s=3.0)
    runs = {}
    reqs = burst_requests()
    for warm in (0, 1):
        scaling = ScalingShape(1, 4, warm, auto, start_s=2.0)
        sim = simulator(
            profile, FleetShape(routing="least_load", replica=ReplicaShape(16, 2048, 0.0), scaling=scaling)
        )
        result = sim.run(reqs)
        runs[warm] = (sim.pool, result.summary(), result)
    for pool, summary, result in runs.values():
        ups = [d for d in pool.decisions if d[1] > 1]
        assert ups and 10.0 <= ups[0][0] < 15.0  # during the burst (it starts at 10 s)
        assert pool.decisions[-1][1] < max(d for _, d, _ in pool.decisions)  # and down after it
        assert summary["completed"] == 180
        # Up less than all four replicas the whole run, more than one.
        assert result.duration_s < result.replica_seconds < 4 * result.duration_s
    # A warm standby takes the burst at once: its requests wait less for a first token.
    assert runs[1][1]["ttft_s"]["p99"] < runs[0][1]["ttft_s"]["p99"]
    assert runs[1][2].replica_seconds > runs[0][2].replica_seconds  # the standby is paid for


@pytest.mark.parametrize("simulator", [FleetSim, FastFleet])
def test_a_pool_at_zero_starts_cold_for_its_first_request(simulator):
    profile = made_up_profile()
    scaling = ScalingShape(0, 2, 0, AutoscaleConfig(), scale_to_zero_after_s=5.0, start_s=3.0)
    sim = simulator(profile, FleetShape(replica=ReplicaShape(16, 2048, 0.0), scaling=scaling))
    rng = random.Random(1)
    reqs = [SimRequest("a", 0.0, tokens(rng, 64), 4), SimRequest("b", 30.0, tokens(rng, 64), 4)]
    result = sim.run(reqs)
    # Each waited for a cold start: the pool went back to zero in between (idle 5 s).
    assert [sent for sent, _ in first_tokens(result)] == [0.0, 30.0]
    assert all(3.0 <= ttft < 3.5 for _, ttft in first_tokens(result))
    assert [d for _, d, _ in sim.pool.decisions] == [1, 0, 1]


def test_a_pool_scaling_up_under_load_waits_for_a_start_beside_busy_replicas():
    """The profile times a start alone and beside a busy replica (on this 2-core host 4.0 and 5.4
    s): a pool with an active replica adds one at the busy start's pace, a pool at zero starts its
    first at the lone start's; either takes traffic at the gateway's next probe after that."""
    profile = made_up_profile()
    profile.startup_s = {"first": 6.0, "again": 2.0, "busy": 5.0}
    auto = AutoscaleConfig(target_inflight=1.0, scale_up_delay_s=0.0)
    found = ScalingShape().probe_interval_s / 2
    busy = Load([3, 0], [2, 0], [0.1, 0.0], 0, None, 0.0)  # its one replica has three in flight
    waiting = Load([0, 0], [0, 0], [0.0, 0.0], 1, None, 0.0)  # a request waits at the gateway
    for low, load, start in ((1, busy, 5.0), (0, waiting, 2.0)):
        pool = SimPool.of(ScalingShape(low, 2, 0, auto, scale_to_zero_after_s=60.0), profile)
        pool.start(0.0)
        pool.tick(1.0, load)
        assert pool.with_state(STARTING) and pool.next_ready() == pytest.approx(1.0 + start + found)
    # The shape's own figure stands for both.
    pool = SimPool.of(ScalingShape(1, 2, 0, auto, start_s=3.0), profile)
    assert pool.start_s == pool.busy_start_s == 3.0 + found


@pytest.mark.parametrize("simulator", [FleetSim, FastFleet])
def test_a_replica_started_again_holds_nothing_of_its_old_cache(simulator):
    """Two requests 30 s apart share a 512-token prefix. A pool that stays up serves the second
    from the cached prefix; one that went to zero in between starts a new replica, which
    computes the whole prompt again (0.2 ms a token in the made-up profile), after its start and
    the gateway's probe that finds it ready (half a probe interval on average), at the
    controller's next tick."""
    rng = random.Random(2)
    head = tokens(rng, 512)
    prompts = [head + tokens(rng, 16) for _ in range(2)]
    reqs = [
        SimRequest(name, at, p, 4, prefix_id=0, prefix_len=512)
        for name, at, p in (("a", 0.0, prompts[0]), ("b", 30.0, prompts[1]))
    ]
    second = {}
    for zero_after in (None, 5.0):
        scaling = ScalingShape(1 if zero_after is None else 0, 1, 0, AutoscaleConfig(), zero_after, 3.0)
        sim = simulator(made_up_profile(), FleetShape(replica=ReplicaShape(16, 2048, 0.0), scaling=scaling))
        second[zero_after] = first_tokens(sim.run(reqs))[1][1]
    started = math.ceil((3.0 + scaling.probe_interval_s / 2) / TICK_S - 1e-6) * TICK_S
    assert second[5.0] - started == pytest.approx(second[None] + 512 * 0.0002, rel=0.05)


def test_the_fast_simulator_scales_a_pool_as_the_exact_one_does():
    """The same burst through both simulators' autoscaled pools: the same decisions at about the
    same times, and latencies and replica-seconds that agree."""
    profile = made_up_profile()
    auto = AutoscaleConfig(target_inflight=4, scale_up_delay_s=0.5, scale_down_delay_s=3.0)
    shape = FleetShape(
        routing="least_load",
        replica=ReplicaShape(16, 2048, 0.0),
        scaling=ScalingShape(1, 4, 0, auto, start_s=2.0),
    )
    reqs = burst_requests(seed=5)
    runs = []
    for simulator in (FleetSim, FastFleet):
        sim = simulator(profile, shape)
        runs.append((sim.pool.decisions, sim.run(reqs).summary()))
    (exact_decisions, exact), (fast_decisions, fast) = runs
    assert [d for _, d, _ in fast_decisions] == [d for _, d, _ in exact_decisions]
    assert all(abs(f[0] - e[0]) <= 1.0 for f, e in zip(fast_decisions, exact_decisions, strict=True))
    for key in ("ttft_s", "e2e_s"):
        for q, within in (("p50", 0.15), ("p99", 0.2)):
            e, f = exact[key][q], fast[key][q]
            assert abs(f - e) <= within * e, (key, q, e, f)
    assert abs(fast["replica_seconds"] - exact["replica_seconds"]) <= 0.1 * exact["replica_seconds"]


@pytest.mark.parametrize(
    ("shape", "said"),
    [
        ({"min_replicas": 3, "max_replicas": 2}, r"min_replicas \(3\) <= max_replicas \(2\)"),
        ({"min_replicas": 0, "max_replicas": 0}, "max_replicas of at least 1"),
        ({"warm_standby": -1}, "warm_standby must be at least 0"),
        ({"autoscale": AutoscaleConfig(target_inflight=0)}, "target_inflight must be above 0"),
    ],
)
def test_a_pool_shape_out_of_range_is_refused_where_it_is_built(shape, said):
    """Not found later as an IndexError or a division by zero inside a run."""
    with pytest.raises(ValueError, match=said):
        ScalingShape(**shape)
