"""shoal/sim: a P/D fleet in both simulators, by the gateway's rule: the prompt prefilled on a
prefill worker, its K/V handed over and decoded on a decode worker, the handoff's costs on each
side, and the gateway's prefill timeout."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from shoal.engine.step_shape import StepShape
from shoal.sim.fast import FastFleet
from shoal.sim.fleet import FleetShape, FleetSim
from shoal.sim.profile import made_up_profile
from shoal.sim.replica import ReplicaShape
from shoal.sim.workload import Lengths, SimRequest, WorkloadSpec, tokens


def test_a_disaggregated_request_is_prefilled_handed_over_and_decoded_by_the_gateways_rule():
    """A P/D fleet in the exact simulator: a long prompt is prefilled on the prefill worker, its K/V
    reaches the decode worker after the prefill worker's part of the handoff (its engine packs the
    K/V) and the pull, and the decode worker loads it and computes only its last prompt token; so
    a lone request's first token comes exactly that long later. A short prompt (under
    disagg_min_prompt_tokens) is prefilled where it decodes."""
    profile = made_up_profile()
    profile.kv_transfer = {"bytes_per_token": 46080.0, "shm_s": 0.008, "shm_s_per_mib": 0.0011}
    profile.kv_transfer.update(prefill_cpu_s=0.001, prefill_cpu_s_per_mib=0.0017)
    profile.kv_transfer.update(decode_cpu_s=0.0, decode_cpu_s_per_mib=0.001)
    shape = FleetShape(0, "least_load", ReplicaShape(16, 2048, 0.0), prefill=1, decode=1)
    rng = random.Random(3)
    long, short = SimRequest("long", 0.0, tokens(rng, 512), 8), SimRequest("short", 10.0, tokens(rng, 100), 8)
    sim = FleetSim(profile, shape)
    for r in sim.replicas:
        r.shapes = []
    result = sim.run([long, short])
    prefill_worker, decode_worker = sim.replicas
    assert [s.tokens for s in prefill_worker.shapes] == [512]  # the long prompt, and only it
    # The decode worker computed the long prompt's last token only (a step shaped like a decode,
    # at the prompt's full context), and all of the short one.
    first = decode_worker.shapes[0]
    assert (first.rows, first.tokens, first.context) == (1, 1, 512)
    assert [s.tokens for s in decode_worker.shapes if s.tokens > s.rows] == [100]
    one = StepShape()
    one.add_row(512, 0)
    last = StepShape()
    last.add_row(1, 511)
    packed = profile.kv_handoff_cpu_seconds(512, "prefill")
    loaded = profile.kv_handoff_cpu_seconds(511, "decode")  # its last token is computed there
    expected = profile.step_seconds(one) + packed + profile.kv_transfer_seconds(512)
    expected += profile.step_seconds(last) + loaded
    ttft = {rec.input_len: rec.ttft for rec in result.records}
    assert ttft[512] == pytest.approx(expected, rel=1e-12)
    assert profile.kv_transfer_seconds(512) == pytest.approx(0.008 + 0.0011 * 512 * 46080 / 2**20)
    assert packed == pytest.approx(0.001 + 0.0017 * 22.5) and loaded == pytest.approx(0.001 * 511 * 45 / 1024)
    alone = StepShape()
    alone.add_row(100, 0)
    assert ttft[100] == pytest.approx(profile.step_seconds(alone), rel=1e-12)
    assert all(r.ok and r.output_tokens == 8 for r in result.records) and not sim.handing
    # The fast simulator splits and prices them the same way.
    fast = FastFleet(profile, shape).run([long, short]).out
    fast_ttft = dict(zip(fast.input_len, fast.ttft, strict=True))
    assert fast_ttft == {n: pytest.approx(ttft[n], rel=1e-12) for n in (100, 512)}
    assert fast.output_tokens == [8, 8]


def test_the_workers_of_a_role_can_run_on_a_profile_of_their_own():
    """A P/D fleet whose decode worker's steps cost twice its profile's (a slower machine, or the
    same host slower for it): the lone request's prompt step on the prefill worker is priced as
    before, and its first token comes later by the one step the decode worker computes, each gap
    after it twice as long. Each role's steps say how far the run stretched them past their price:
    the prefill worker's not at all, the decode worker's by loading the handed K/V."""
    profile = made_up_profile()
    profile.kv_transfer = {"bytes_per_token": 46080.0, "shm_s": 0.008, "shm_s_per_mib": 0.0011}
    profile.kv_transfer.update(decode_cpu_s=0.0, decode_cpu_s_per_mib=0.001)
    shape = FleetShape(0, "least_load", ReplicaShape(16, 2048, 0.0), prefill=1, decode=1)
    request = SimRequest("long", 0.0, tokens(random.Random(3), 512), 8)
    same = FleetSim(profile, shape).run([request])
    slow = FleetSim(profile, shape, {"decode": profile.at_speed(2.0)}).run([request])
    last = StepShape()
    last.add_row(1, 511)
    assert slow.records[0].ttft - same.records[0].ttft == pytest.approx(profile.step_seconds(last))
    gaps = [np.diff(r.records[0].chunk_times) for r in (same, slow)]
    assert gaps[1] == pytest.approx(2 * gaps[0], rel=1e-9)
    assert slow.step_stretch["prefill"] == 1.0 and slow.step_stretch["decode"] > 1.0


def test_a_prefill_worker_packs_a_handoff_before_its_next_step():
    """A prefill worker's engine packs a finished prompt's K/V between two steps: a second prompt
    that came while the first was computed waits for that too. With packing made to cost a second
    (ten prompt steps), the second request's first token comes after both packings, in both
    simulators; without the rule it came a second sooner."""
    profile = made_up_profile()
    profile.kv_transfer = {"bytes_per_token": 46080.0, "shm_s": 0.0, "shm_s_per_mib": 0.0}
    profile.kv_transfer.update(prefill_cpu_s=1.0, prefill_cpu_s_per_mib=0.0)
    shape = FleetShape(0, "least_load", ReplicaShape(16, 2048, 0.0), prefill=1, decode=1)
    rng = random.Random(4)
    reqs = [SimRequest(f"r{i}", 0.001 * i, tokens(rng, 512), 2) for i in range(2)]
    one = StepShape()
    one.add_row(512, 0)
    step = profile.step_seconds(one)
    assert step < 0.2  # a packing costs more than five prompt steps
    exact = sorted(r.ttft + r.start for r in FleetSim(profile, shape).run(reqs).records)
    fast = FastFleet(profile, shape).run(reqs).out
    fast_firsts = sorted(t + s for t, s in zip(fast.ttft, fast.start, strict=True))
    # The second prompt's step starts once the first one's K/V is packed; its own is packed next.
    assert exact[1] > 2 * step + 2 * 1.0
    assert fast_firsts == pytest.approx(exact, rel=1e-9)


def test_a_remote_prefill_past_the_gateways_timeout_is_prefilled_on_the_decode_worker():
    """The gateway's prefill_timeout_s in both simulators: six long prompts at once on a prefill
    worker that takes one a step, the timeout after three and a half of its steps. The first three
    are handed over; the fourth, in its step at the timeout, is computed there all the same but
    not handed; the last two leave its queue. The decode worker prefills those three itself (every
    prompt token of theirs, against one for a handed prompt), and their first tokens come after the
    timeout, the others' before it. With the gateway's default timeout, none is."""
    profile = made_up_profile()
    profile.kv_transfer = {"bytes_per_token": 46080.0, "shm_s": 0.008, "shm_s_per_mib": 0.0011}
    profile.kv_transfer.update(prefill_cpu_s=0.001, prefill_cpu_s_per_mib=0.0017)
    one = StepShape()
    one.add_row(512, 0)
    unit = profile.step_seconds(one) + profile.kv_handoff_cpu_seconds(512, "prefill")
    timeout = 3.5 * unit
    rng = random.Random(5)
    reqs = [SimRequest(f"r{i}", 0.001 * i, tokens(rng, 512), 8) for i in range(6)]
    shape = FleetShape(
        0, "least_load", ReplicaShape(16, 512, 0.0), prefill=1, decode=1, prefill_timeout_s=timeout
    )
    sim = FleetSim(profile, shape)
    for r in sim.replicas:
        r.shapes = []
    records = sorted(sim.run(reqs).records, key=lambda r: r.start)
    prefill_worker, decode_worker = sim.replicas
    assert [s.tokens for s in prefill_worker.shapes] == [512] * 4
    assert sum(s.tokens for s in decode_worker.shapes) == 3 * 8 + 3 * (512 + 7)
    assert all(r.ok and r.output_tokens == 8 for r in records) and not sim.handing
    late = [r.start + r.ttft > timeout for r in records]
    assert late == [False] * 3 + [True] * 3
    assert not prefill_worker.scheduler.num_unfinished and not prefill_worker.tracked
    fast_fleet = FastFleet(profile, shape)
    fast = fast_fleet.run(reqs).out
    assert fast.ttft == pytest.approx([r.ttft for r in records], rel=1e-9)
    assert fast_fleet.replicas[0].steps == 4 and fast.output_tokens == [8] * 6
    patient = FleetSim(profile, replace(shape, prefill_timeout_s=FleetShape.prefill_timeout_s))
    patient.replicas[1].shapes = []
    patient.run(reqs)
    assert sum(s.tokens for s in patient.replicas[1].shapes) == 6 * 8


def test_the_fast_simulator_splits_a_pd_fleet_as_the_exact_one_does():
    """P/D fleets with shared prefixes: a prompt whose prefix its decode worker holds is prefilled
    there when what is left is short, else on a prefill worker (which kv_aware routing must not
    take for cached: the index is read before this request is noted in it, as dispatch does)."""
    profile = made_up_profile()
    profile.kv_transfer = {"bytes_per_token": 46080.0, "shm_s": 0.008, "shm_s_per_mib": 0.0011}
    spec = WorkloadSpec(
        num_requests=1200,
        rate=10.0,
        input_len=Lengths("uniform", 512, 400),
        output_len=Lengths("uniform", 128, 96),
        num_prefixes=8,
        prefix_len=256,
        seed=3,
    )
    for routing, p, d in (("kv_aware", 1, 3), ("least_load", 2, 2)):
        shape = FleetShape(0, routing, ReplicaShape(64, 2048), prefill=p, decode=d)
        sim = FleetSim(profile, shape)
        exact = sim.run(spec.requests()).summary()
        fast_fleet = FastFleet(profile, shape)
        fast = fast_fleet.run(spec.requests(with_tokens=False)).summary()
        # About half the prompts have 256 or more tokens past their prefix: those, and only those
        # (give or take a prefix not yet cached where it decodes), go to a prefill worker.
        prefill_steps = [sum(f.replicas[i].steps for i in range(p)) for f in (sim, fast_fleet)]
        assert 0.35 * 1200 < prefill_steps[0] < 0.6 * 1200, prefill_steps
        assert abs(prefill_steps[1] - prefill_steps[0]) <= 0.1 * prefill_steps[0], prefill_steps
        for key in ("ttft_s", "itl_s", "e2e_s"):
            for q, within in (("p50", 0.1), ("p99", 0.2)):
                e, f = exact[key][q], fast[key][q]
                assert abs(f - e) <= within * e, (routing, key, q, e, f)
        thr = exact["output_token_throughput"], fast["output_token_throughput"]
        assert abs(thr[1] - thr[0]) <= 0.02 * thr[0], (routing, thr)
