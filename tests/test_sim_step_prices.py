"""What the simulator prices a step and a handoff at: steps drawn around their price by the spread
real ones show (step noise), and a prefill worker's handoff CPU never below its engine's packing."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shoal.sim.fast import FastFleet
from shoal.sim.fleet import FleetShape, FleetSim
from shoal.sim.kv_handoff import fit_line
from shoal.sim.profile import made_up_profile
from shoal.sim.replica import ReplicaShape
from shoal.sim.workload import SimRequest, tokens


def test_a_prefill_servers_handoff_cpu_is_never_priced_below_its_engines_packing():
    """The prefill server's CPU beyond its steps holds its engine's packing. Where contention made
    the server's readings flat (as in one CI run), the line takes the engine's slope at the
    readings' own level, so a big handoff stays dearer than a small one; a steeper reading stays."""
    mib = [2.8, 11.25, 45.0]
    flat = [(m, 0.015 + noise) for m, noise in zip(mib * 3, [0.002, -0.001, 0.0, 0.0, 0.001, -0.002] * 2)]
    packing = 4e-4  # seconds a MiB, the engine alone
    fixed, per_mib = fit_line(flat)
    assert per_mib < packing  # as read: nearly flat
    fixed, per_mib = fit_line(flat, least_per_mib=packing)
    assert per_mib == packing
    assert fixed + per_mib * np.mean(mib) == pytest.approx(np.mean([t for _, t in flat]))
    profile = made_up_profile()
    profile.kv_transfer = {"bytes_per_token": 46080.0, "prefill_cpu_s": fixed}
    profile.kv_transfer["prefill_cpu_s_per_mib"] = per_mib
    small, big = (profile.kv_handoff_cpu_seconds(n, "prefill") for n in (64, 1024))
    assert big - small == pytest.approx(packing * (45.0 - 2.8125))
    steep = [(m, 0.002 + 9e-4 * m) for m in mib]
    assert fit_line(steep, least_per_mib=packing) == pytest.approx((0.002, 9e-4))


def test_steps_stray_from_their_price_as_the_step_noise_says_and_a_run_repeats():
    """With step noise each step is drawn around its price: one on average, the log's spread as
    given for each kind of step; the same run gives the same steps, another noise seed others. The
    fast simulator, which prices steps in aggregate, refuses it, and a negative spread is refused."""
    profile = made_up_profile()
    rng = random.Random(5)
    reqs = [SimRequest(f"r{i}", 0.0, tokens(rng, 256), rng.randint(32, 96)) for i in range(96)]

    def run(decode_noise: float, prompt_noise: float, seed: int = 0):
        replica = ReplicaShape(32, 2048, 0.0, decode_noise, prompt_noise, seed)
        sim = FleetSim(profile, FleetShape(1, replica=replica, max_concurrency=16))
        shapes, took, start = [], [], sim.replicas[0].start_step
        sim.replicas[0].shapes = shapes

        def timed(now: float, stretch: float = 1.0):
            ends = start(now, stretch)
            if ends is not None:
                took.append(ends - now)
            return ends

        sim.replicas[0].start_step = timed
        records = sim.run(reqs).records
        ratios = [t / profile.step_seconds(s) for s, t in zip(shapes, took, strict=True)]
        return records, shapes, ratios

    exact = run(0.0, 0.0)
    assert exact[2] == pytest.approx([1.0] * len(exact[2]), rel=1e-12)
    records, shapes, ratios = run(0.15, 0.06)
    for decode_only, sd in ((True, 0.15), (False, 0.06)):
        mine = np.array([r for s, r in zip(shapes, ratios, strict=True) if s.decode_only == decode_only])
        assert len(mine) > 60
        assert mine.mean() == pytest.approx(1.0, abs=0.03)
        assert np.log(mine).std() == pytest.approx(sd, rel=0.25)
    again = run(0.15, 0.06)[0]
    assert [(r.ttft, r.e2e) for r in again] == [(r.ttft, r.e2e) for r in records]
    assert [r.ttft for r in records] != [r.ttft for r in exact[0]]
    # Another seed is another draw of the same spread (runs pooled over draws are the expectation).
    _, other_shapes, other = run(0.15, 0.06, seed=3)
    decode = np.array([r for s, r in zip(other_shapes, other, strict=True) if s.decode_only])
    assert np.log(decode).std() == pytest.approx(0.15, rel=0.25)
    assert other[: len(ratios)] != ratios[: len(other)]
    with pytest.raises(ValueError, match="fast simulator"):
        FastFleet(profile, FleetShape(1, replica=ReplicaShape(decode_step_noise=0.1)))
    with pytest.raises(ValueError, match="prompt_step_noise"):
        ReplicaShape(prompt_step_noise=-0.1)
