"""shoal profile against a real server: the profile's K/V handoff times, the serving calibration
(a known answer), and the simulator predicting a real `shoal serve` within 20 %."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from shoal.bench.serve import ServeBenchConfig, run_serve_bench
from shoal.engine.step_shape import StepShape
from shoal.engine.step_trace import STEP_TRACE_ENV, Gap, read_gaps, read_steps, step_trace_files
from shoal.fleet.control.cores import host_cpus
from shoal.sim.fleet import FleetShape, FleetSim
from shoal.sim.profile import DECODE_FEATURES, NodeProfile, StepCost, made_up_profile
from shoal.sim.profiler import (
    FrontCPU,
    ProfileConfig,
    calibration_requests,
    fold_serving,
    measure,
)
from shoal.sim.replica import ReplicaShape
from shoal.sim.speed_probe import probe_seconds, traced_kind_speeds, traced_speed
from shoal.sim.startup_timing import busy_start_seconds, server_start_seconds
from shoal.sim.workload import Lengths, WorkloadSpec
from tests.fleet_helpers import metric, start_gateway
from tests.server_helpers import start_server


def calibration_runs(served: NodeProfile) -> tuple:
    """fold_serving's arguments, from runs simulated from `served` (a server's stand-in) whose
    requests spend 30 ms outside the engine."""

    def run(clients: int, requests: int, prompt: int, output: int) -> dict:
        spec = WorkloadSpec(requests, input_len=Lengths("fixed", prompt), output_len=Lengths("fixed", output))
        shape = FleetShape(1, replica=ReplicaShape(16, 2048, 0.03), max_concurrency=clients)
        return FleetSim(served, shape).run(spec.requests()).summary()

    runs = [(b, run(b, calibration_requests(b), 128, 48)) for b in (1, 4, 16)]
    return runs, 128, 48, (512, run(1, 4, 512, 2))


@pytest.mark.parametrize("knots", [[], [1, 4, 16]], ids=["line", "knots"])
def test_the_serving_calibration_finds_what_serving_adds_to_each_step(knots):
    """Runs simulated from a profile whose steps cost 2 ms more, and 0.5 ms more a row, whose prompt
    tokens cost 1.3 times the bare ones, and whose requests spend 30 ms outside the engine, stand in
    for a server's runs (a known answer): folded into the bare profile, they give those costs back.
    The gaps a new prompt's prefill puts between the others' tokens are in the bare runs too, so
    they are not taken for serving (priced against bare decode steps instead, both costs came out
    5-6 % high on these made-up costs, more where a prompt costs more against a decode step)."""
    bare = made_up_profile()
    if knots:
        step, row, context = bare.decode.coef
        bare.decode = StepCost(DECODE_FEATURES, [*(step + row * k for k in knots), context], knots=knots)
    served = copy.deepcopy(bare)
    added_step, added_row = 0.002, 0.0005
    coef = bare.decode.coef
    if knots:
        served.decode.coef = [*(c + added_step + added_row * k for c, k in zip(coef, knots)), coef[-1]]
    else:
        served.decode.coef = [coef[0] + added_step, coef[1] + added_row, coef[2]]
    served.mixed.coef[0] += added_step
    served.mixed.coef[1] += added_row
    served.mixed.coef[2] *= 1.3
    served.mixed.coef[3] *= 1.3
    fold_serving(bare, *calibration_runs(served))
    assert bare.serving["prompt_scale"] == pytest.approx(1.3, rel=0.01)
    assert bare.serving["per_request_s"] == pytest.approx(0.03, rel=0.01)
    assert bare.serving["per_step_s"] == pytest.approx(added_step, rel=0.01)
    assert bare.serving["per_row_s"] == pytest.approx(added_row, rel=0.01)
    assert bare.decode.coef == pytest.approx(served.decode.coef, rel=0.01)
    assert bare.mixed.coef == pytest.approx(served.mixed.coef, rel=0.01)


def test_prompt_lengths_that_barely_change_a_bare_step_leave_the_prompt_price_alone():
    """On a GPU a 512-token prompt's step costs about what a 128-token one's does (a step's
    launches): the difference of their first tokens is noise there, and pricing prompt tokens by it
    multiplied them up to the cap (x3 on an H200). Such a calibration keeps the bare price."""
    bare = made_up_profile()
    bare.mixed.coef = [0.010, 0.0005, 1e-6, 0.0, 0.0]  # 512 tokens: 0.4 ms more than 128, of 10.6
    served = copy.deepcopy(bare)
    served.mixed.coef[2] *= 3
    fold_serving(bare, *calibration_runs(served))
    assert bare.serving["prompt_scale"] == 1.0
    assert bare.mixed.coef[2] == 1e-6


def test_served_prompts_are_never_priced_under_the_bare_ones():
    """Served prompts that came out cheaper than the bare engine's (this machine faster while the
    server ran: x0.89 here once, where the P/D row's prefill worker then ran its prompt steps at
    the bare engine's speed) keep the bare price: serving computes the same prompt, and more."""
    bare = made_up_profile()
    served = copy.deepcopy(bare)
    served.mixed.coef[2] *= 0.8
    served.mixed.coef[3] *= 0.8
    fold_serving(bare, *calibration_runs(served))
    assert bare.serving["prompt_scale"] == 1.0
    assert bare.mixed.coef[2] == made_up_profile().mixed.coef[2]


def test_a_host_that_ran_the_served_runs_slower_is_not_taken_for_serving():
    """The served runs came from a host 15 % slower than when the bare steps were timed, and the
    speed probe right before them said so: set against the bare steps at that speed, they give
    back what serving adds (30 ms a request, nothing a step or a row) and the bare step costs,
    where without the probe the host's drift came out as serving: 1.5 ms a step, 0.08 ms a row
    and prompts at x1.15."""
    bare = made_up_profile()
    slow = bare.at_speed(1.15)
    drifted = copy.deepcopy(bare)
    fold_serving(drifted, *calibration_runs(slow))
    assert drifted.serving["per_step_s"] + 16 * drifted.serving["per_row_s"] > 0.002
    assert drifted.serving["prompt_scale"] > 1.1
    fold_serving(bare, *calibration_runs(slow), speed=1.15)
    assert bare.serving["per_request_s"] == pytest.approx(0.03, rel=0.01)
    assert bare.serving["per_step_s"] == pytest.approx(0.0, abs=1e-4)
    assert bare.serving["per_row_s"] == pytest.approx(0.0, abs=1e-5)
    assert bare.serving["prompt_scale"] == pytest.approx(1.0) and bare.serving["speed"] == 1.15
    assert bare.decode.coef == pytest.approx(made_up_profile().decode.coef, rel=0.01)
    assert bare.mixed.coef == pytest.approx(made_up_profile().mixed.coef, rel=0.01)


def test_a_traced_engines_speed_is_its_busy_time_over_the_steps_prices():
    """Steps that took 1.2 times their price, 4 ms between two while work waited and 3 s once while
    none did: the engine was busy 1.2 times their price and 4 ms after each step; what the
    simulator charges itself between steps (a prefill worker's packing) is not counted twice. A
    long gap after a step that left requests to run is the engine's own work (a prefill worker
    packing four prompts' K/V), however long; the same gap after a step that left none is a wait
    for work, as is one whose step did not say (a trace from before steps said)."""
    profile = made_up_profile()
    shapes = [StepShape(4, 4, 512, 512), StepShape(1, 256, 256, 256 * 257 // 2), StepShape(8, 8, 900, 900)]
    steps = [(s, 1.2 * profile.step_seconds(s)) for s in shapes]
    priced = sum(profile.step_seconds(s) for s in shapes)
    assert traced_speed(profile, steps) == pytest.approx(1.2)
    waited = [Gap(0.004, 2), Gap(3.0, 0)]
    assert traced_speed(profile, steps, waited) == pytest.approx(1.2 + 3 * 0.004 / priced)
    packing = 0.01
    assert traced_speed(profile, steps, waited, packing) == pytest.approx(
        1.2 + (3 * 0.004 - packing) / priced
    )
    worked = [Gap(0.004, 0), Gap(0.09, 3)]
    assert traced_speed(profile, steps, worked) == pytest.approx(1.2 + 3 * (0.094 / 2) / priced)
    for idle in (0, None):
        assert traced_speed(profile, steps, [Gap(0.004, 0), Gap(0.09, idle)]) == pytest.approx(
            1.2 + 3 * 0.004 / priced
        )


def test_each_kind_of_step_has_its_traced_speed_and_a_profile_prices_each_at_its_own():
    """Decode steps that took 0.9 times their price and prompt steps 1.1 times (a pool's burst here:
    x0.94 and x1.04): each kind reads its own speed, the engine's work between steps shared evenly
    among them and a prefill worker's packing taken from the prompts; a profile at those speeds
    prices each kind of step at its own, and one at a single speed is the same at both."""
    profile = made_up_profile()
    decode = [StepShape(4, 4, 512, 512), StepShape(8, 8, 900, 900)]
    prompt = [StepShape(1, 256, 256, 256 * 257 // 2), StepShape(3, 130, 400, 8400)]
    steps = [(s, 0.9 * profile.step_seconds(s)) for s in decode]
    steps += [(s, 1.1 * profile.step_seconds(s)) for s in prompt]
    speeds = traced_kind_speeds(profile, steps)
    assert speeds == pytest.approx({"decode": 0.9, "prompt": 1.1})
    packing, gap = 0.01, 0.004
    priced = {
        k: sum(profile.step_seconds(s) for s in shapes)
        for k, shapes in (("decode", decode), ("prompt", prompt))
    }
    assert traced_kind_speeds(profile, steps, [Gap(gap, 1), Gap(3.0, 0)], packing) == pytest.approx(
        {"decode": 0.9 + 2 * gap / priced["decode"], "prompt": 1.1 + (2 * gap - packing) / priced["prompt"]}
    )
    assert traced_kind_speeds(profile, steps[:2]) == pytest.approx({"decode": 0.9})  # a kind it ran
    at = profile.at_speeds(speeds["decode"], speeds["prompt"])
    for shape, seconds in steps:
        assert at.step_seconds(shape) == pytest.approx(seconds)
    one = profile.at_speed(1.3)
    assert [one.step_seconds(s) for s, _ in steps] == pytest.approx(
        [1.3 * profile.step_seconds(s) for s, _ in steps]
    )


ENGINE = dict(max_model_len=1024, kv_cache_memory=256 << 20, max_num_seqs=16)
SERVE_FLAGS = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def node_profile(tmp_path_factory):
    """This machine's profile of the bundled model as the server below runs it (a quick one)."""
    profile = _node_profile()
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    profile.save(path)
    return NodeProfile.load(path)


def test_the_profile_times_kv_handoffs_by_their_size(node_profile, hf_bundled):
    """The profile pulled real K/V handoffs from a prefill worker: their size per token is the
    model's K and V of every layer (fp32 on this CPU, from HF's config of the same checkpoint),
    and the handoff's time grows with its size, over both transports."""
    c = hf_bundled.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    t = node_profile.kv_transfer
    assert t["bytes_per_token"] == 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
    for way in ("shm", "tcp"):
        assert t[f"{way}_s"] >= 0 and t[f"{way}_s_per_mib"] >= 0
        assert node_profile.kv_transfer_seconds(1024, way) >= node_profile.kv_transfer_seconds(64, way) > 0
    # The CPU each worker spends on one: packing and writing it, reading and loading it.
    for side in ("prefill", "decode"):
        cpu = [node_profile.kv_handoff_cpu_seconds(n, side) for n in (64, 1024)]
        assert cpu[1] > cpu[0] > 0
    assert "KV transfer : 46080 B a token" in node_profile.describe()
    assert "handoff CPU : prefill worker" in node_profile.describe()


def test_a_replicas_start_is_timed_to_its_servers_first_ready_answer():
    """What a fleet waits for before it routes to a replica it started: the server's process up to
    its first ready answer; alone, and beside a busy replica. (It once was the engine's start and
    more; since a start stopped reading the GGUF a second time, the server loads its model while
    its front starts, and here was ready within the engine's own time, 5.5 s, give or take.)"""
    assert server_start_seconds(SERVE_FLAGS) > 0
    # A pool's scale-up: a one-core start beside a replica on the other cores that serves clients
    # (BusyClients raises if they were refused, busy_start_seconds if the replica streamed nothing
    # over the starts). Not asserted: that it is slower than a start alone. Its toll here
    # ran from 30 % down to 3 %, with what the busy one computed then (its streams' clients take
    # the cores' time, its prefills none), as the host's speed from one minute to the next;
    # once the mean of three busy starts read 2 % under the faster of two alone.
    cores = len(host_cpus())
    if cores > 1:
        assert busy_start_seconds([*SERVE_FLAGS, "--threads", "1"], starts=1) > 0  # one is a start
    assert busy_start_seconds([*SERVE_FLAGS, "--threads", str(cores)]) is None


def _node_profile(kv_transfer: bool = True) -> NodeProfile:
    cfg = ProfileConfig(ENGINE, decode_batches=(1, 4, 8, 16), contexts=(64, 384), prompt_lengths=(64, 256))
    cfg.repeats, cfg.startup, cfg.serve_flags = 1, False, SERVE_FLAGS
    if not kv_transfer:  # a round's profile: the handoffs are not in its workload
        cfg.kv_transfer_lengths = ()
    return measure(cfg)


def _errors(profile: NodeProfile) -> dict[str, tuple[float, float, float]]:
    """The real server's figures and the simulator's from `profile` at the host's speed over the
    run (its engine's own steps against the profile's prices): (measured, predicted, error)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        server = start_server(*SERVE_FLAGS, env={STEP_TRACE_ENV: trace_dir})
        try:
            measured = run_serve_bench(
                ServeBenchConfig(
                    base_url=server.url, num_requests=32, input_len=128, output_len=48, max_concurrency=8
                )
            )
        finally:
            server.stop()
        (trace,) = step_trace_files(trace_dir)  # the server's one engine
        speeds = traced_kind_speeds(profile, read_steps(trace), read_gaps(trace))
        profile = profile.at_speeds(speeds["decode"], speeds["prompt"])
    spec = WorkloadSpec(num_requests=32, input_len=Lengths("fixed", 128), output_len=Lengths("fixed", 48))
    shape = FleetShape(1, replica=ReplicaShape(max_num_seqs=16), max_concurrency=8)
    predicted = FleetSim(profile, shape).run(spec.requests()).summary()
    # The mean inter-token time, not the median: the simulator prices each step at its average (see
    # fold_serving), and stalls on a loaded machine put the median well under the mean.
    pairs = {
        "throughput": (measured["output_token_throughput"], predicted["output_token_throughput"]),
        "TTFT p50": (measured["ttft_s"]["p50"], predicted["ttft_s"]["p50"]),
        "ITL mean": (measured["itl_s"]["mean"], predicted["itl_s"]["mean"]),
    }
    return {k: (m, p, (p - m) / m) for k, (m, p) in pairs.items()}


def _misses(errors: dict[str, float]) -> dict[str, str]:
    return {k: f"{100 * e:+.0f} %" for k, e in errors.items() if abs(e) > 0.2}


def test_the_simulator_predicts_a_real_server_within_20_percent(node_profile):
    """32 requests (128 prompt, 48 output tokens) from 8 clients at a time against `shoal serve`, and
    the same workload simulated from the node's profile at the host's speed over the run: the
    server's own traced steps against the profile's prices (a speed probe right before and after
    the run until then). This machine is shared, and its speed moves by 10-20 % between a profile
    and a run a minute later, either way (the server alone measured 158 to 231 tokens/s in rounds
    back to back). Five rounds, each from a fresh profile, before the probe: throughput -7.5, -4.8,
    +3.7, +2.5, -2.4 %; TTFT p50 +2.5, +2.6, -6.8, -4.3, -3.1 %; mean ITL +18, +11, 0, -5.3, +10 %
    (before the calibration priced a served prompt's tokens, TTFT p50 was +34, +11, +12, +31,
    -19 %). So a round that misses is followed by four more, each from a fresh profile taken right
    before, and each figure's median error over the five is what must hold: noise moves it both
    ways, a simulator that is off by itself moves it the same way every round (three rounds were
    too few: two slow profiles in a row failed one in CI)."""
    rounds = [_errors(node_profile)]
    if _misses({k: e for k, (_, _, e) in rounds[0].items()}):
        rounds += [_errors(_node_profile(kv_transfer=False)) for _ in range(4)]
    median = {k: float(np.median([r[k][2] for r in rounds])) for k in rounds[0]}
    assert not _misses(median), rounds


@contextlib.contextmanager
def busy_loops():
    """Two busy processes for each core of this host: a one-thread engine then gets at most a
    third of a core (a 1.3x slowdown is then far inside what it sees, whatever else runs; with one
    a core, at best 1.5x, a run in CI read 1.28x)."""
    spin = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(spin) for _ in range(2 * len(host_cpus()))]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def test_the_speed_probe_sees_a_slower_host_and_rescales_a_profile_by_it(node_profile):
    """The profile keeps its speed probe's time; the same probe later, with every core of this host
    also running two busy loops, takes longer, and the profile rescaled by the ratio prices every
    step that much higher, leaving what serving adds per request and the handoffs as measured."""
    assert node_profile.probe_s > 0 and "speed probe :" in node_profile.describe()
    options = {**ENGINE, "num_threads": 1}
    alone = probe_seconds(options)
    with busy_loops():
        crowded = probe_seconds(options)
    assert crowded > 1.3 * alone
    slow = node_profile.at_speed(crowded / alone)
    one = StepShape()
    one.add_row(256, 0)
    for shape in (one, StepShape(4, 4, 1024, 1024)):
        assert slow.step_seconds(shape) == pytest.approx(crowded / alone * node_profile.step_seconds(shape))
    assert slow.serving == node_profile.serving and slow.kv_transfer == node_profile.kv_transfer


def test_the_fronts_cpu_a_token_is_what_a_gateway_takes_beyond_its_idle_polls():
    """A real gateway in front of a real replica: idle, it still spends CPU (its polls of the
    replica's /load and KV events, its probes), and streaming tokens costs it more than that; the
    calibration's price a token is the part beyond its idle rate (FrontCPU), which the simulator
    charges apart (SharedCores.front_idle_cores, for each replica it watches)."""
    server = start_server(*SERVE_FLAGS)
    gateway = None
    try:
        gateway = start_gateway([server.url])
        front = FrontCPU(gateway.proc.pid)
        idle = front.idle_cores(2.0)
        assert 0.0 < idle < 0.5
        bench = ServeBenchConfig(gateway.url, num_requests=8, input_len=64, output_len=32, max_concurrency=4)
        streamed = run_serve_bench(bench)["total_output_tokens"]
        beyond = front.seconds() - idle * front.elapsed()
        assert streamed == 8 * 32 and 0.0 < beyond / streamed < 0.01, (beyond, streamed)
    finally:
        if gateway is not None:
            gateway.stop()
        server.stop()


def test_a_servers_own_steps_read_a_slower_host(node_profile):
    """A server whose engine traces its steps: one trace line a step it ran (its own count, on
    /metrics), and the steps it ran with every core of this host also running two busy loops read
    slower against the profile than the same requests' steps without; the profile keeps what its
    own served steps read against it, by kind."""
    assert "served steps: decode x" in node_profile.describe()
    bench = ServeBenchConfig(num_requests=8, input_len=128, output_len=24, max_concurrency=4)
    with tempfile.TemporaryDirectory() as trace_dir:
        server = start_server(*SERVE_FLAGS, env={STEP_TRACE_ENV: trace_dir})
        try:
            run_serve_bench(dataclasses.replace(bench, base_url=server.url))
            (trace,) = step_trace_files(trace_dir)
            alone = read_steps(trace)
            assert len(alone) == metric(server.url, "shoal:engine_steps_total")
            # Each line says when its step ended: one step starts after the one before it ended,
            # so the gaps between them are what the engine did between its steps.
            lines = [json.loads(line) for line in trace.read_text().splitlines()]
            gaps = [b["ended"] - b["seconds"] - a["ended"] for a, b in itertools.pairwise(lines)]
            assert min(gaps) >= 0 and len(gaps) == len(alone) - 1
            assert [g.seconds for g in read_gaps(trace)] == pytest.approx(gaps)
            # ... and what the engine still had to run as each step ended: the first step's prompt
            # still had tokens to come, the 4 clients never had more than 4 requests in it, and
            # the last step finished the last of them.
            pending = [line["pending"] for line in lines]
            assert pending[0] >= 1 and max(pending) <= 4 and pending[-1] == 0
            with busy_loops():
                run_serve_bench(dataclasses.replace(bench, base_url=server.url, seed=2))
            crowded = read_steps(trace)[len(alone) :]
        finally:
            server.stop()
    assert traced_speed(node_profile, crowded) > 1.3 * traced_speed(node_profile, alone)
