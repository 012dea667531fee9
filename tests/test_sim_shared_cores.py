"""The simulator's rule for a fleet whose replicas, gateway and clients share one host's cores
(shoal/sim/cores.py), on made-up costs with a known answer."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from shoal.sim.cores import MAX_STOLEN
from shoal.sim.fast import FastFleet
from shoal.sim.fleet import FleetShape, FleetSim
from shoal.sim.profile import made_up_profile
from shoal.sim.replica import ReplicaShape
from shoal.sim.workload import Lengths, WorkloadSpec

FRONT = 0.0005  # CPU seconds the front spends a token streamed


def _profile(front: float | None = FRONT):
    """Made-up step costs, calibrated with one replica pinned to one of two cores."""
    profile = made_up_profile()
    profile.num_threads = 1
    profile.serving = {"per_step_s": 0.0, "per_row_s": 0.0, "per_request_s": 0.0}
    if front is not None:
        profile.serving |= {"front_cpu_s_per_token": front, "cores": 2}
    return profile


def _itl_median(profile, replicas: int, shared: int | None) -> float:
    spec = WorkloadSpec(8 * replicas, input_len=Lengths("fixed", 64), output_len=Lengths("fixed", 200))
    shape = FleetShape(replicas, "round_robin", ReplicaShape(16, 2048, 0.0), shared_cores=shared)
    return FleetSim(profile, shape).run(spec.requests()).summary()["itl_s"]["p50"]


def test_two_replicas_filling_both_cores_pay_for_the_tokens_their_front_streams():
    """Two replicas of one thread each on two cores, 8 rows each, steady: the front needs FRONT
    seconds of CPU for every token, and no core is free for it, so each replica gives up that much
    of its own: a step of T seconds streams 8 tokens a replica, the front takes 8 * FRONT of each
    replica's T, and T = bare step + 8 * FRONT."""
    bare = _itl_median(_profile(), 2, None)
    assert _itl_median(_profile(), 2, 2) == pytest.approx(bare + 8 * FRONT, rel=0.02)


def test_the_gateways_idle_cpu_is_taken_for_each_replica_it_watches():
    """The same two replicas, their gateway also spending IDLE of a core on each of them whatever
    streams (its polls): the front then needs 2 * IDLE cores more than its tokens' CPU, taken
    evenly from the two replicas' cores, so a step of T seconds keeps T * (1 - IDLE) for its
    own work and the tokens': T = (bare step + 8 * FRONT) / (1 - IDLE)."""
    idle = 0.05
    bare = _itl_median(_profile(), 2, None)
    profile = _profile()
    profile.serving["gateway_idle_cpu_s_per_s"] = idle
    assert _itl_median(profile, 2, 2) == pytest.approx((bare + 8 * FRONT) / (1 - idle), rel=0.02)


def test_a_free_core_or_a_free_front_leaves_the_steps_alone_and_an_unmeasured_one_is_refused():
    """One replica on two cores leaves the front the core the calibration left it, and a front that
    costs nothing takes nothing; a profile calibrated without the front's CPU cannot say what
    sharing costs, and the simulator says so rather than ignore the cores."""
    alone = _itl_median(_profile(), 1, None)
    assert _itl_median(_profile(), 1, 2) == pytest.approx(alone)
    assert _itl_median(_profile(front=0.0), 2, 2) == pytest.approx(_itl_median(_profile(), 2, None))
    with pytest.raises(ValueError, match="through-gateway"):
        FleetSim(_profile(front=None), FleetShape(2, shared_cores=2))


def test_a_costlier_front_never_makes_a_step_cheaper_and_takes_at_most_its_share():
    """Front costs from nothing to more than the two cores hold: the steps' stretch never falls as
    the front costs more (a rule that capped the calibration's share and the fleet's apart gave
    a stretch of 1 again past 1.8 cores of front), and never passes the most the front may take
    (MAX_STOLEN of a replica's threads: steps at most 5 x their bare cost)."""
    plain = _itl_median(_profile(), 2, None)
    stretches = [_itl_median(_profile(front=f), 2, 2) / plain for f in (0.0, 0.0005, 0.002, 0.005, 0.02, 0.1)]
    assert stretches[0] == pytest.approx(1.0)
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(stretches)), stretches
    assert stretches[2] > 1.05
    assert stretches[-1] == pytest.approx(1 / (1 - MAX_STOLEN), rel=0.02)


def test_the_fast_simulator_and_the_command_refuse_shared_cores(tmp_path):
    with pytest.raises(ValueError, match="shared cores"):
        FastFleet(_profile(), FleetShape(2, shared_cores=2))
    path = tmp_path / "profile.json"
    _profile().save(path)
    sim = [sys.executable, "-m", "shoal.cli", "sim", "--profile", str(path), "--shared-cores", "2"]
    out = subprocess.run([*sim, "--mode", "fast", "--num-requests", "4"], capture_output=True, text=True)
    assert out.returncode == 2 and "--shared-cores needs the exact simulator" in out.stderr
    args = ["--replicas", "2", "--num-requests", "8", "--max-concurrency", "8"]
    ok = subprocess.run([*sim, *args], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bare = tmp_path / "bare.json"
    _profile(front=None).save(bare)
    refused = subprocess.run(
        [*sim[:4], "--profile", str(bare), "--shared-cores", "2", *args], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "through-gateway" in refused.stderr
    assert "exact" in ok.stdout
    assert np.isfinite(float(ok.stdout.split("throughput")[1].split()[1]))


def test_a_replica_starting_up_holds_its_cores_from_the_front():
    """A pool of one to two one-thread replicas on two cores, whose second replica is asked for and
    never ready within the run (its start takes a day): while it starts, its process holds its
    core (imports, weights), so the front's CPU comes out of the one replica serving, as it
    would with two computing; a pool that never asks for a second replica keeps the core free
    for the front. Same requests, same replica serving them all."""
    from shoal.fleet.control.autoscaler import AutoscaleConfig
    from shoal.sim.scaling import ScalingShape

    spec = WorkloadSpec(24, input_len=Lengths("fixed", 64), output_len=Lengths("fixed", 200))

    def itl(max_replicas: int) -> tuple[float, list]:
        scaling = ScalingShape(1, max_replicas, 0, AutoscaleConfig(target_inflight=4.0), start_s=86400.0)
        shape = FleetShape(1, "round_robin", ReplicaShape(16, 2048, 0.0), scaling=scaling, shared_cores=2)
        sim = FleetSim(_profile(), shape)
        return sim.run(spec.requests()).summary()["itl_s"]["mean"], sim.pool.decisions

    alone, decided_alone = itl(1)
    starting, decided = itl(2)
    assert not decided_alone and decided[0][1] == 2  # only the second pool asked for another
    assert starting > 1.05 * alone


def test_the_simulator_says_how_far_sharing_stretched_its_steps():
    """What a run's steps took against their price (`step_stretch`: the accuracy benchmark takes it
    out of the real engines' traced steps to read the host's own speed): exactly 1 with cores of
    its own; two replicas sharing two cores with their front run steady steps stretched by the
    front's share (the ITL's stretch), and so the run as a whole."""
    spec = WorkloadSpec(16, input_len=Lengths("fixed", 64), output_len=Lengths("fixed", 200))

    def run(shared: int | None) -> dict:
        shape = FleetShape(2, "round_robin", ReplicaShape(16, 2048, 0.0), shared_cores=shared)
        return FleetSim(_profile(), shape).run(spec.requests()).summary()

    alone, shared = run(None), run(2)
    assert alone["step_stretch"] == {"both": 1.0}
    itl_stretch = shared["itl_s"]["p50"] / alone["itl_s"]["p50"]
    assert itl_stretch > 1.2
    assert shared["step_stretch"]["both"] == pytest.approx(itl_stretch, rel=0.05)
