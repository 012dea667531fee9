"""`shoal plan`: the fewest replicas that meet an SLO, P/D fleets sized phase by phase, an
autoscaled pool's bounds, and parallel shapes ranked by devices; on made-up profiles, checked
against the simulators themselves (fast, then exact)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from shoal.sim.fast import FastFleet
from shoal.sim.fleet import FleetShape, FleetSim
from shoal.sim.gateways import GatewaySizing, size_gateways
from shoal.sim.planner import SLO, PlanConfig, check, fleet_check, pd_capacity, pd_check, plan, plan_scaling
from shoal.sim.profile import made_up_profile
from shoal.sim.workload import Burst, Lengths, WorkloadSpec


def test_the_planner_finds_the_fewest_replicas_that_meet_the_slo():
    profile = made_up_profile()
    spec = WorkloadSpec(rate=30.0, input_len=Lengths("fixed", 512), output_len=Lengths("fixed", 64), seed=2)
    cfg = PlanConfig(SLO(ttft_p99_s=0.5), batch_sizes=(8, 32), chunk_sizes=(2048,), requests_per_check=600)
    cfg.disaggregated = False
    rows, best = plan(profile, spec, cfg)
    assert best is not None and best.floor <= best.replicas <= best.split
    assert all(r.replicas is None or r.replicas >= best.replicas for r in rows)
    # The split: one replica at rate / N holds the SLO at the split's N and not at one fewer.
    assert cfg.slo.met(check(profile, best.shape, spec, best.split, cfg))
    assert best.split == 1 or not cfg.slo.met(check(profile, best.shape, spec, best.split - 1, cfg))
    # The whole fleet behind the gateway's routing: the fewest, by the exact simulator too.
    fleet = fleet_check(profile, best.shape, spec, best.replicas, cfg)
    assert cfg.slo.met(fleet)
    exact = FleetSim(profile, FleetShape(best.replicas, cfg.routing, best.shape))
    exact_summary = exact.run(replace(spec, num_requests=300 * best.replicas).requests()).summary()
    assert exact_summary["ttft_s"]["p99"] <= 1.2 * cfg.slo.ttft_p99_s
    if best.replicas > best.floor:
        assert not cfg.slo.met(fleet_check(profile, best.shape, spec, best.replicas - 1, cfg))
    doubled = fleet_check(profile, best.shape, spec, best.replicas, cfg, scale=2.0)
    assert doubled["ttft_s"]["p99"] > fleet["ttft_s"]["p99"]


def test_the_planner_bounds_an_autoscaled_pool_through_bursts():
    """A minute at 4x over a steady load: the fixed fleet is sized for it; a pool of it that keeps
    fewer replicas up outside it holds the SLO with fewer replica-seconds, and one replica fewer
    kept up does not (the exact simulator agrees on the pool)."""
    profile = made_up_profile()
    profile.startup_s = {"first": 6.0, "again": 4.0}
    spec = WorkloadSpec(
        4000, 8.0, [Burst(120.0, 60.0, 4.0)], Lengths("fixed", 512), Lengths("fixed", 64), seed=2
    )
    cfg = PlanConfig(SLO(ttft_p99_s=3.0), batch_sizes=(64,), chunk_sizes=(2048,), requests_per_check=4000)
    cfg.disaggregated = False
    _, best = plan(profile, spec, cfg)
    scaling = plan_scaling(profile, spec, best, cfg)
    pool = scaling.scaling
    assert best.replicas >= 2 and pool.max_replicas == best.replicas and pool.min_replicas < best.replicas
    assert cfg.slo.met(scaling.summary) and scaling.summary["completed"] == 4000
    assert scaling.summary["replica_seconds"] < 0.9 * scaling.fixed["replica_seconds"]
    assert " % fewer)" in scaling.describe()
    # A pool dearer than the fixed fleet (a steady load) says so, not "-10 % fewer".
    dearer = {**scaling.summary, "replica_seconds": 1.1 * scaling.fixed["replica_seconds"]}
    assert "(10 % more)" in replace(scaling, summary=dearer).describe()
    if pool.min_replicas > 1:
        fewer = replace(pool, min_replicas=pool.min_replicas - 1)
        fleet = FleetShape(routing=cfg.routing, replica=best.shape, scaling=fewer)
        assert not cfg.slo.met(FastFleet(profile, fleet).run(spec.requests(False)).summary())
    fleet = FleetShape(routing=cfg.routing, replica=best.shape, scaling=pool)
    exact = FleetSim(profile, fleet).run(spec.requests()).summary()
    assert exact["ttft_s"]["p99"] <= 1.2 * cfg.slo.ttft_p99_s
    assert (
        abs(exact["replica_seconds"] - scaling.summary["replica_seconds"]) <= 0.1 * exact["replica_seconds"]
    )


def test_shoal_plan_compares_parallel_shapes_by_the_devices_they_take(tmp_path):
    """One profile per parallel shape: each is planned, and the fleets are ranked by devices
    (replicas x TP x PP), not replicas."""
    tp1 = made_up_profile()
    tp2 = made_up_profile()
    tp2.tensor_parallel = 2
    tp2.decode.coef = [c * 0.6 for c in tp2.decode.coef]
    tp2.mixed.coef = [c * 0.55 for c in tp2.mixed.coef]
    paths = [tmp_path / "tp1.json", tmp_path / "tp2.json"]
    tp1.serving["gateway_cpu_s_per_token"] = GATEWAY_CPU  # tp2's calibration timed no gateway
    tp1.save(paths[0])
    tp2.save(paths[1])
    flags = ["--rate", "10", "--input-len", "512", "--output-len", "64", "--slo-ttft-ms", "500"]
    cmd = [sys.executable, "-m", "shoal.cli", "plan", "--profile", str(paths[0]), "--profile", str(paths[1])]
    out = subprocess.run(
        [*cmd, *flags, "--no-pd", "--no-autoscale", "--what-if", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    ranked = out.stdout.split("by parallel shape")[1].strip().splitlines()[1:]
    cfg = PlanConfig(SLO(ttft_p99_s=0.5))  # the command's own settings
    cfg.disaggregated = False
    spec = WorkloadSpec(rate=10.0, input_len=Lengths("fixed", 512), output_len=Lengths("fixed", 64))
    wanted = []
    for profile in (tp1, tp2):
        best = plan(profile, spec, cfg)[1]
        wanted.append((best.replicas * profile.tensor_parallel, profile.tensor_parallel, best.replicas))
    wanted.sort()
    assert len(ranked) == 2
    # Both fleets relay the same tokens; only tp1's profile says what a token costs a gateway.
    said = [line for line in out.stdout.splitlines() if line.startswith("gateways:")]
    assert said == [f"gateways: {math.ceil(10 * 64 * GATEWAY_CPU / 0.7) + 1}", said[1]]
    assert "not sized" in said[1] and "--through-gateway" in said[1]
    for line, (n, tp, replicas) in zip(ranked, wanted, strict=True):
        assert line.strip().startswith(f"TP={tp} PP=1: {replicas} replicas") and line.endswith(
            f": {n} devices"
        )


GATEWAY_CPU = 0.004  # seconds of a gateway's CPU a token streamed (a made-up, costly gateway)


def test_gateways_are_sized_by_the_tokens_they_relay_with_one_to_lose():
    """100 requests/s of 64 tokens through gateways whose token costs GATEWAY_CPU: 25.6 cores of
    relaying, each gateway kept under 70 % of its one core (37), and one spare; a profile that
    timed no gateway sizes none, and a gateway busier than its core is refused."""
    profile = made_up_profile()
    assert size_gateways(profile, 100.0, 64) is None
    profile.serving["gateway_cpu_s_per_token"] = GATEWAY_CPU
    sized = size_gateways(profile, 100.0, 64)
    assert sized.cores == pytest.approx(25.6) and sized.gateways == 37 + 1
    assert size_gateways(profile, 100.0, 64, GatewaySizing(busy=1.0, spares=0)).gateways == 26
    assert size_gateways(profile, 0.001, 1).gateways == 2  # at least one, and its spare
    assert "6,400 tokens/s" in sized.notes[0] and "38 gateways" in sized.notes[1]
    with pytest.raises(ValueError, match="busy"):
        GatewaySizing(busy=1.5)


def test_the_planner_sizes_each_phase_of_a_pd_fleet():
    """P/D fleets of the shapes near the cheapest: the fewest prefill workers that hold the TTFT
    bound (with decode workers to spare), the fewest decode workers behind them; the exact
    simulator agrees that the fleet holds the SLO."""
    profile = made_up_profile()
    profile.kv_transfer = {"bytes_per_token": 46080.0, "tcp_s": 0.008, "tcp_s_per_mib": 0.0025}
    spec = WorkloadSpec(rate=30.0, input_len=Lengths("fixed", 512), output_len=Lengths("fixed", 64), seed=2)
    slo = SLO(ttft_p99_s=0.5, itl_p99_s=0.05)
    cfg = PlanConfig(slo, batch_sizes=(8, 32), chunk_sizes=(2048,), requests_per_check=600)
    rows, best = plan(profile, spec, cfg)
    pd = [r for r in rows if r.prefill]
    assert pd and all(r.replicas is not None for r in pd)
    c = min(pd, key=lambda r: r.replicas)
    p, d = c.prefill, c.decode
    assert best.replicas <= c.replicas and p >= 1 and d >= 1
    # Prefill workers carry the load the arithmetic says, decode workers theirs.
    per_prefill, per_decode = pd_capacity(profile, c.shape, spec)
    assert p >= spec.rate / per_prefill and d >= spec.rate / per_decode
    assert slo.met(pd_check(profile, c.shape, spec, p, d, cfg))
    assert not slo.met(pd_check(profile, c.shape, spec, p, d - 1, cfg))
    assert not slo.met(pd_check(profile, c.shape, spec, p - 1, d + 1, cfg))
    # Aggregated, prompt steps stall the decodes: the ITL bound holds only on mostly idle replicas.
    aggregated = min(r.replicas for r in rows if not r.prefill and r.replicas is not None)
    assert best is c and aggregated > 1.5 * c.replicas
    exact = FleetSim(profile, c.fleet(cfg)).run(replace(spec, num_requests=1500).requests()).summary()
    assert exact["ttft_s"]["p99"] <= 1.2 * slo.ttft_p99_s and exact["itl_s"]["p99"] <= 1.2 * slo.itl_p99_s
