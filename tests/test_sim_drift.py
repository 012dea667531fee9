"""A host's speed drifting over a run (shoal/sim/drift.py): read from traced steps, and the
simulator replaying the run at each moment's speed, on made-up costs with a known answer."""

from __future__ import annotations

import itertools

import pytest

from shoal.engine.step_shape import StepShape
from shoal.sim.drift import MIN_PRICED_S, SpeedDrift
from shoal.sim.fleet import FleetShape, FleetSim
from shoal.sim.profile import made_up_profile
from shoal.sim.replica import ReplicaShape
from shoal.sim.workload import Lengths, WorkloadSpec


def _decode(rows: int) -> StepShape:
    return StepShape(rows, rows, 64 * rows, 64 * rows)


def test_a_traced_drift_is_each_windows_speed_against_the_runs():
    """Steps timed at 1.2 and then 0.8 times their price, as much priced in each 10 s window, then
    a window of too few steps to read: the drift is 1.2 and 0.8 of the run's mean (1.0), and the
    thin window runs at the mean; a step is placed by its start, the clock's zero is the run's
    start, and a moment past the last window takes the last."""
    profile = made_up_profile()
    shape = _decode(8)
    price = profile.step_seconds(shape)
    per_window = int(2 * MIN_PRICED_S / price) + 1
    start, steps, t = 1000.0, [], 1000.0
    for factor, n in ((1.2, per_window), (0.8, per_window)):
        window_end = t + 10.0
        for _ in range(n):
            steps.append((shape, factor * price, t + factor * price))
            t += factor * price
        t = window_end
    steps.append((shape, 3 * price, t + 3 * price))  # one step: a window too thin to read
    assert t + 3 * price < start + 30.0
    drift = SpeedDrift.traced(profile, steps, start, window_s=10.0)
    mean = (1.2 + 0.8 + 3 / per_window) / (2 + 1 / per_window)
    assert drift.factors == pytest.approx((1.2 / mean, 0.8 / mean, 1.0))
    assert drift.at(0.0) == drift.at(9.9) == drift.factors[0]
    assert drift.at(10.0) == drift.factors[1] and drift.at(1e6) == 1.0
    # Steps untimed (a trace from before steps said when they ended): no drift.
    assert SpeedDrift.traced(profile, [(s, sec, None) for s, sec, _ in steps], start).at(5.0) == 1.0


def test_the_simulator_runs_each_window_at_its_drift_and_does_not_call_it_stretch():
    """One replica decoding 4 requests of 800 tokens, the host twice as slow for the first 5 s: the steps
    that start in that window take twice what the same steps take after it (their inter-token
    times), the run takes longer than without the drift, and its steps' stretch (what sharing
    cores adds, which the accuracy benchmark divides out) stays 1, by window too; so does taking
    out a stretch of 1."""
    profile = made_up_profile()
    spec = WorkloadSpec(4, input_len=Lengths("fixed", 32), output_len=Lengths("fixed", 800))
    shape = FleetShape(1, "round_robin", ReplicaShape(16, 2048, 0.0))
    drift = SpeedDrift((2.0, 1.0), window_s=5.0)
    steady = FleetSim(profile, shape).run(spec.requests())
    drifted = FleetSim(profile, shape, drift={"both": drift}).run(spec.requests())
    chunks = drifted.records[0].chunk_times
    early = [b - a for a, b in itertools.pairwise(chunks[5:]) if b < 4.5]
    late = [b - a for a, b in itertools.pairwise(chunks) if a > 5.5]
    assert len(early) > 10 and len(late) > 10
    assert sorted(early)[len(early) // 2] == pytest.approx(2 * sorted(late)[len(late) // 2], rel=0.02)
    assert drifted.duration_s > steady.duration_s + 2.0
    assert drifted.step_stretch == {"both": pytest.approx(1.0)}
    assert drifted.window_stretch["both"] == pytest.approx([1.0] * len(drifted.window_stretch["both"]))
    assert steady.window_stretch == {}
    assert drift.without([1.0, 1.0], 1.0) == drift


def test_taking_out_the_simulators_own_stretch_leaves_the_hosts_drift():
    """The real steps of a window ran slower for the host and for what the simulator charges itself
    there (shared cores): the simulator's stretch of each window against its mean comes out of the
    drift, once; a window it did not run keeps its factor."""
    drift = SpeedDrift((1.2, 0.9, 1.1), window_s=10.0)
    assert drift.without([1.3, 1.04], 1.04).factors == pytest.approx((1.2 * 1.04 / 1.3, 0.9, 1.1))
