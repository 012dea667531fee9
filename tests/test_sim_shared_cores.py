"""The simulator's rule for a fleet whose replicas, gateway and clients share one host's cores
(shoal/sim/cores.py), on made-up costs with a known answer."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

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


def test_a_free_core_or_a_front_never_measured_leaves_the_steps_alone():
    """One replica on two cores leaves the front the core the calibration left it; a profile
    calibrated without a gateway's CPU time has nothing to take; a step never gets cheaper."""
    alone = _itl_median(_profile(), 1, None)
    assert _itl_median(_profile(), 1, 2) == pytest.approx(alone)
    assert _itl_median(_profile(front=None), 2, 2) == pytest.approx(_itl_median(_profile(), 2, None))
    assert _itl_median(_profile(front=0.0), 2, 2) == pytest.approx(_itl_median(_profile(), 2, None))


def test_the_front_taking_more_than_the_cores_left_in_calibration_is_priced_as_the_difference():
    """A front so costly that the calibration's free core could not hold it either (its replica
    paid the excess then, and the profile's steps carry it): only what sharing adds is priced."""
    profile = _profile(front=0.01)
    plain, shared = _itl_median(profile, 2, None), _itl_median(profile, 2, 2)
    assert plain < shared < plain / (1 - 0.8)  # stretched, never past the most the front may take
    rows_rate = 16 / shared  # tokens a second both replicas stream, steady
    demand = 0.01 * rows_rate
    taken, taken_alone = min(0.8, demand / 2), min(0.8, max(0.0, demand - 1))
    assert shared / plain == pytest.approx((1 - taken_alone) / (1 - taken), rel=0.05)


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
    assert "exact" in ok.stdout
    assert np.isfinite(float(ok.stdout.split("throughput")[1].split()[1]))
