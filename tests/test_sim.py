"""shoal/sim: the simulated replica steps as the engine schedules, the profile's fit, the gateway's
routing inside the simulator, a server's front end and its clients, and a gateway trace
replayed. P/D fleets: test_sim_disaggregation.py. Autoscaled pools: test_sim_pool.py. The
profile's calibration against a real server, and the simulator's accuracy against one:
test_sim_calibration.py."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import httpx
import numpy as np
import pytest

from shoal.engine.sampling_params import SamplingParams
from shoal.engine.step_shape import StepShape
from shoal.engine.step_trace import read_steps
from shoal.llm import LLM
from shoal.sim.fast import FastFleet
from shoal.sim.fleet import FleetShape, FleetSim, SimResult
from shoal.sim.profile import (
    DECODE_FEATURES,
    MIXED_FEATURES,
    NodeProfile,
    StepCost,
    made_up_profile,
)
from shoal.sim.replica import ReplicaShape
from shoal.sim.step_samples import StepRecorder, merge_decode_runs, write_samples
from shoal.sim.workload import Lengths, SimRequest, WorkloadSpec, load_trace, tokens
from tests.fleet_helpers import start_gateway
from tests.sim_helpers import first_tokens


def synthetic_profile(num_blocks: int = 4096, max_len: int = 2048, block_size: int = 16) -> NodeProfile:
    return made_up_profile(num_blocks, max_len, block_size)


def test_a_simulated_replica_schedules_every_step_as_the_engine_does(bundled):
    """Chunked prefill (a 64-token budget), shared prefixes (prefix hits) and a pool too small for
    all of it (preemption): the simulator's steps have the engine's own shapes, step for step."""
    rng = random.Random(3)
    head = tokens(rng, 48)
    prompts = [(head if i % 2 else []) + tokens(rng, rng.randint(20, 140)) for i in range(12)]
    max_tokens = [rng.randint(8, 40) for _ in prompts]
    options = dict(num_blocks=40, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=512)
    llm = LLM(loaded=bundled, quantization="none", **options)
    rec = StepRecorder(llm.engine, seed=0)
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        llm.engine.add_request(f"r{i}", p, params)
    rec.run()
    engine_steps = [(s.rows, s.tokens, s.context, s.admitted) for s, _ in rec.samples]
    preempted = llm.engine.core.scheduler.num_preemptions
    assert preempted > 0  # the case covers preemption
    # Each request is admitted by one step, and again by one after each time it was preempted.
    assert sum(admitted for *_, admitted in engine_steps) == len(prompts) + preempted
    assert engine_steps[0][3] > 1  # the first step takes in several prompts at once

    profile = synthetic_profile(num_blocks=40, max_len=512)
    shape = FleetShape(1, replica=ReplicaShape(max_num_seqs=6, max_num_batched_tokens=64), offline=True)
    sim = FleetSim(profile, shape)
    shapes = sim.replicas[0].shapes = []
    result = sim.run([SimRequest(f"r{i}", 0.0, p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))])
    assert [(s.rows, s.tokens, s.context, s.admitted) for s in shapes] == engine_steps
    assert sum(r.output_tokens for r in result.records) == sum(max_tokens)


def test_the_step_cost_fit_recovers_the_costs_that_made_the_steps():
    rng = np.random.default_rng(0)
    truth_decode, truth_mixed = [0.004, 0.0003, 2e-7], [0.006, 0.0002, 0.00015, 3e-9, 4e-8]
    decode, mixed = [], []
    for _ in range(200):
        s = StepShape()
        for _ in range(int(rng.integers(1, 64))):
            s.add_row(1, int(rng.integers(10, 2000)))
        decode.append(s)
        m = StepShape()
        # One to four prompts a step: only several tell a step's size from each prompt's attention.
        for _ in range(int(rng.integers(1, 5))):
            m.add_row(int(rng.integers(16, 512)), int(rng.integers(0, 512)))
        for _ in range(int(rng.integers(0, 16))):
            m.add_row(1, int(rng.integers(10, 2000)))
        mixed.append(m)
    noisy = lambda cost, features: float(np.dot(cost, features)) * rng.normal(1, 0.02)  # noqa: E731
    d_seconds = [noisy(truth_decode, [1, s.rows, s.context]) for s in decode]
    m_seconds = [noisy(truth_mixed, [1, s.rows, s.tokens, s.attention, s.tokens**2]) for s in mixed]
    d = StepCost.fit(DECODE_FEATURES, decode, d_seconds)
    m = StepCost.fit(MIXED_FEATURES, mixed, m_seconds)
    np.testing.assert_allclose(d.coef, truth_decode, rtol=0.15)
    np.testing.assert_allclose(m.coef, truth_mixed, rtol=0.15)
    assert d.error_p50 < 0.03 and m.error_p50 < 0.03
    # A profile taken before the step-size feature prices steps with its four (and the fast
    # simulator the same: test_a_step_costs_the_same_priced_from_its_features_as_from_its_shape).
    old, one = StepCost(MIXED_FEATURES[:4], truth_mixed[:4]), mixed[0]
    by_hand = float(np.dot(truth_mixed[:4], [1, one.rows, one.tokens, one.attention]))
    assert old.seconds(one) == pytest.approx(by_hand)


def test_a_run_of_decode_steps_is_fitted_as_its_mean(tmp_path):
    """Steps of one batch that spread widely (a GPU decoding ahead) weigh in at their mean, each run of
    one batch size apart, and a step with a prompt stays a step of its own."""

    def step(rows: int, context: int, prompt: int = 0) -> StepShape:
        s = StepShape()
        for i in range(rows):
            s.add_row(1, context + i)
        if prompt:
            s.add_row(prompt, 0)
        return s

    steps = [(step(4, 100 + i), t) for i, t in enumerate([0.001, 0.009, 0.002, 0.008])]
    steps += [
        (step(4, 104, prompt=64), 0.03),
        (step(5, 105), 0.004),
        (step(5, 107), 0.006),
        (step(3, 50), 0.002),
    ]
    merged = merge_decode_runs(steps)
    assert [(s.rows, s.tokens, s.context) for s, _ in merged] == [
        (4, 4, step(4, 101).context + 2),  # contexts 100..103: the mean of the four steps
        (5, 68, step(4, 104, prompt=64).context),
        (5, 5, step(5, 105).context + 5),
        (3, 3, step(3, 50).context),
    ]
    assert [t for _, t in merged] == pytest.approx([0.005, 0.03, 0.005, 0.002])
    # Written out and read back (a GPU lease's steps, fitted again here), they are the same steps.
    write_samples(steps, tmp_path / "steps.jsonl")
    assert read_steps(tmp_path / "steps.jsonl") == steps
    # An engine's trace cut short mid-line (its replica killed) keeps every whole step.
    with open(tmp_path / "steps.jsonl", "a") as f:
        f.write('{"rows": 3, "tok')
    assert read_steps(tmp_path / "steps.jsonl") == steps


def test_kv_aware_routing_in_the_simulator_finds_the_shared_prefixes():
    """The gateway's own kv_aware policy, fed by the simulated replicas' KV events, sends prompts
    where their prefix is: far more prompt tokens come from the cache than under round robin."""
    spec = WorkloadSpec(
        num_requests=400,
        rate=40.0,
        input_len=Lengths("fixed", 512),
        output_len=Lengths("fixed", 16),
        num_prefixes=8,  # two a replica fit its pool; all eight do not
        prefix_len=448,
        seed=1,
    )
    hit = {}
    for routing in ("kv_aware", "round_robin"):
        sim = FleetSim(synthetic_profile(num_blocks=100), FleetShape(4, routing))
        result = sim.run(spec.requests())
        assert result.summary()["completed"] == 400
        kv = [r.kv for r in sim.replicas]
        hit[routing] = sum(k.prefix_hits for k in kv) / sum(k.prefix_queries for k in kv)
    assert hit["kv_aware"] > 0.65 > 0.4 > hit["round_robin"], hit


def test_the_simulated_gateway_routes_on_queues_as_it_last_polled_them():
    """As the real gateway does, between its polls of each replica's /load it knows the queues only
    as that poll found them (and its own count of requests in flight, exact): every route sees the
    last poll's queues, and a burst sees them out of date."""
    spec = WorkloadSpec(
        num_requests=200, rate=40.0, input_len=Lengths("fixed", 256), output_len=Lengths("fixed", 32), seed=2
    )
    sim = FleetSim(synthetic_profile(), FleetShape(2, "least_load", load_poll_interval_s=0.25))
    events = []  # in order: ("poll", queues) and ("route", queues seen, queues then)

    def queues(names):
        return {
            n: {
                "running": len(sim.by_name[n].scheduler.running),
                "waiting": len(sim.by_name[n].scheduler.waiting),
            }
            for n in names
        }

    poll, choose = sim._poll_loads, sim.policy.choose

    def polling():
        poll()
        events.append(("poll", queues(sim.by_name)))

    def choosing(candidates, req):
        names = [c.name for c in candidates]
        events.append(("route", {c.name: dict(c.load) for c in candidates}, queues(names)))
        return choose(candidates, req)

    sim._poll_loads, sim.policy.choose = polling, choosing
    result = sim.run(spec.requests())
    assert result.summary()["completed"] == 200
    last, stale = None, 0
    for event in events:
        if event[0] == "poll":
            last = event[1]
            continue
        _, seen, then = event
        assert seen == {n: last[n] for n in seen}
        stale += seen != then
    polls = sum(e[0] == "poll" for e in events)
    assert polls <= result.duration_s / 0.25 + 2
    assert stale > 20, stale


def test_the_fast_simulator_agrees_with_the_exact_one():
    """The fast simulator's aggregate rules against the engine's own scheduler, on fleets with
    shared prefixes, a pool small enough to preempt, and both routing kinds."""
    spec = WorkloadSpec(
        num_requests=1500,
        rate=14.0,
        input_len=Lengths("uniform", 512, 256),
        output_len=Lengths("uniform", 128, 96),
        num_prefixes=8,
        prefix_len=384,
        seed=3,
    )
    for routing, blocks in (("kv_aware", 4096), ("least_load", 300)):
        profile = synthetic_profile(num_blocks=blocks)
        shape = FleetShape(4, routing, ReplicaShape(64, 2048))
        exact = FleetSim(profile, shape).run(spec.requests()).summary()
        fast = FastFleet(profile, shape).run(spec.requests(with_tokens=False)).summary()
        for key, within in (("ttft_s", 0.5), ("itl_s", 0.25), ("e2e_s", 0.15)):
            e, f = exact[key]["p50"], fast[key]["p50"]
            assert abs(f - e) <= within * e, (routing, key, e, f)
        thr = exact["output_token_throughput"], fast["output_token_throughput"]
        assert abs(thr[1] - thr[0]) <= 0.02 * thr[0], (routing, thr)


def test_a_step_costs_the_same_priced_from_its_features_as_from_its_shape():
    """StepCost.cost (the fast simulator's) equals StepCost.seconds to the bit, for linear and
    interpolated models, also after a calibration replaced the coefficients."""
    rng = random.Random(5)
    models = [
        StepCost(DECODE_FEATURES, [0.010, 0.0005, 1e-7]),
        StepCost(MIXED_FEATURES, [0.010, 0.0005, 0.0002, 1e-9, 3e-11]),
        StepCost(MIXED_FEATURES[:4], [0.010, 0.0005, 0.0002, 1e-9]),  # a profile from before tokens_sq
        StepCost(("rows=1", "rows=8", "rows=32", "context"), [0.01, 0.03, 0.09, 1e-6], knots=[1, 8, 32]),
    ]
    for model in models:
        for calibrated in (False, True):
            if calibrated:
                model.coef = [c * 1.3 + 1e-4 for c in model.coef]  # as calibrate_to_server does
            for _ in range(2000):
                shape = StepShape()
                for _ in range(rng.randint(1, 40)):
                    shape.add_row(rng.choice([1, rng.randint(1, 600)]), rng.randint(0, 2000))
                got = model.cost(shape.rows, shape.tokens, shape.context, shape.attention)
                assert got == model.seconds(shape)


@pytest.mark.parametrize("simulator", [FleetSim, FastFleet])
def test_a_burst_to_an_idle_server_starts_with_its_first_request_alone(simulator):
    """Eight requests sent at once: a server's front end hands them to the idle engine one at a
    time, so its first step prefills the first alone and the next step the other seven (beside
    the first one's decode); an offline batch (FleetShape.offline) prefills all eight in one step."""
    spec = WorkloadSpec(num_requests=8, input_len=Lengths("fixed", 64), output_len=Lengths("fixed", 4))
    reqs = spec.requests(with_tokens=simulator is FleetSim)
    profile = made_up_profile()
    one, eight = (profile.step_seconds(_prompts(n, 64)) for n in (1, 8))
    after_one = _prompts(7, 64)
    after_one.add_row(1, 64)
    seven = profile.step_seconds(after_one)
    ttfts = {}
    for offline in (False, True):
        shape = FleetShape(1, replica=ReplicaShape(16, 2048, 0.0), offline=offline)
        ttfts[offline] = sorted(t for _, t in first_tokens(simulator(profile, shape).run(reqs)))
    assert ttfts[False] == pytest.approx([one] + [one + seven] * 7)
    assert ttfts[True] == pytest.approx([eight] * 8)


def _prompts(n: int, length: int) -> StepShape:
    shape = StepShape()
    for _ in range(n):
        shape.add_row(length, 0)
    return shape


@pytest.mark.parametrize("simulator", [FleetSim, FastFleet])
def test_a_capped_client_sends_its_next_request_after_it_sees_the_last_ones_end(simulator):
    """One client, one request at a time, 0.25 s spent outside the engine per request (HTTP, its
    hops): the next request reaches the engine 0.25 s after the engine finished the last one,
    which the client saw end 0.25 s late, so each request starts as the last one's e2e ends."""
    spec = WorkloadSpec(num_requests=4, input_len=Lengths("fixed", 64), output_len=Lengths("fixed", 8))
    reqs = spec.requests(with_tokens=simulator is FleetSim)
    runs = {}
    for overhead in (0.0, 0.25):
        shape = FleetShape(1, replica=ReplicaShape(16, 2048, overhead), max_concurrency=1)
        runs[overhead] = simulator(made_up_profile(), shape).run(reqs)
    plain, slow = (sorted(_starts_and_e2e(runs[o])) for o in (0.0, 0.25))
    engine_time = plain[0][1]
    for i, (start, e2e) in enumerate(slow):
        assert start == pytest.approx(i * (engine_time + 0.25))
        assert e2e == pytest.approx(engine_time + 0.25)
    assert runs[0.25].duration_s == pytest.approx(runs[0.0].duration_s + 3 * 0.25)


def _starts_and_e2e(result) -> list[tuple[float, float]]:
    if isinstance(result, SimResult):
        return [(r.start, r.e2e) for r in result.records]
    return list(zip(result.out.start, result.out.e2e, strict=True))


MODEL = "SmolLM2-135M-Instruct"


def test_a_gateways_trace_replays_in_the_simulator(chat_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    gw = start_gateway([chat_server.url], "--record-trace", str(trace))
    try:
        sent = []
        for i in range(4):
            body = {"model": MODEL, "prompt": f"Count to {i + 3}:" * (i + 1), "max_tokens": 5 + i}
            body["ignore_eos"] = True
            resp = httpx.post(gw.url + "/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            sent.append(resp.json()["usage"])
        resp = httpx.post(
            gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}, timeout=60
        )
        assert resp.status_code == 400
    finally:
        gw.stop()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    ok = [rec for rec in lines if rec["ok"]]
    assert [(r["input_len"], r["output_len"]) for r in ok] == [
        (u["prompt_tokens"], u["completion_tokens"]) for u in sent
    ]
    assert all(r["t"] > 0 and r["tenant"] and r["block_hashes"] is not None for r in ok)
    reqs = load_trace(trace)
    assert len(reqs) == len(lines) == len(sent) + 1  # the refused one arrived too
    assert [(len(r.prompt), r.output_len) for r in reqs[: len(sent)]] == [
        (u["prompt_tokens"], u["completion_tokens"]) for u in sent
    ]
    assert reqs[0].arrival == 0.0 and all(a.arrival <= b.arrival for a, b in itertools.pairwise(reqs))
    result = FleetSim(synthetic_profile(), FleetShape(1)).run(reqs)
    assert result.summary()["completed"] == len(reqs)


def test_a_trace_that_cannot_be_written_is_refused_at_start(tmp_path):
    cmd = [sys.executable, "-m", "shoal.cli", "gateway", "--backend", "http://127.0.0.1:9"]
    out = subprocess.run(
        [*cmd, "--record-trace", str(tmp_path / "no" / "t.jsonl")], capture_output=True, text=True
    )
    assert out.returncode == 2 and "cannot record the trace" in out.stderr and "Traceback" not in out.stderr
