"""The fleet controller and its autoscaler: decisions with hysteresis on the serving signals, then a
real fleet of two models that starts with no active replica, promotes a warm standby for the first
request, starts a replica for a model at zero, scales up under a burst and back to zero when idle,
without failing a request."""

from __future__ import annotations

import asyncio
import shutil
import time

import httpx
import pytest

from shoal.fleet.config import load_fleet_config
from shoal.fleet.control.autoscaler import AutoscaleConfig, Autoscaler, Signals
from shoal.models.checkpoint import BUNDLED_NAME
from tests.fleet_helpers import metric, spawn, wait_until

CFG = AutoscaleConfig(target_inflight=4, target_waiting=4, target_kv_usage=0.8, scale_up_delay_s=1.0)


def signals(
    active: int, inflight: float = 0, queued: int = 0, kv: float = 0.0, idle: float = 0.0, desired: int = -1
) -> Signals:
    return Signals(active, inflight, queued, 0, kv, None, idle, desired)


def test_scale_up_waits_for_its_delay_and_moves_a_bounded_step():
    a = Autoscaler(CFG, 1, 8, None)
    assert not a.decide(signals(1, inflight=20), 0.0).changed  # wanted, not yet for long enough
    d = a.decide(signals(1, inflight=20), 1.0)
    assert d.changed and d.desired == 3 and d.signal == "inflight"  # 5 wanted, 2 at a time
    assert not a.decide(signals(3, inflight=13), 1.1).changed  # 13 / 3 within 10 % of 4: steady


def test_a_replica_on_its_way_counts_and_is_not_asked_for_twice():
    a = Autoscaler(CFG, 1, 8, None)
    # 2 asked for, 1 still loading: 5 in flight is 1.25 replicas' worth, within what is coming.
    for t in range(5):
        d = a.decide(signals(1, inflight=5, desired=2), float(t))
        assert d.desired == 2 and not d.changed


def test_a_blip_does_not_scale_and_kv_usage_is_a_signal():
    a = Autoscaler(CFG, 1, 8, None)
    assert not a.decide(signals(2, inflight=20), 0.0).changed
    assert not a.decide(signals(2, inflight=2), 0.5).changed  # the burst passed: the clock resets
    assert not a.decide(signals(2, inflight=20), 1.2).changed
    d = a.decide(signals(2, inflight=2, kv=0.95), 2.3)
    assert d.changed and d.desired == 3 and d.signal == "kv_usage"


def test_scale_down_only_when_the_survivors_absorb_the_load():
    a = Autoscaler(AutoscaleConfig(target_inflight=4, scale_down_delay_s=10), 1, 8, None)
    # 3 replicas, 7.5 in flight: 2 would carry 3.75 each, within target but not under it less 10 %.
    for t in range(0, 30, 5):
        assert not a.decide(signals(3, inflight=7.5), float(t)).changed
    assert not a.decide(signals(3, inflight=4), 40.0).changed  # low, but only just now
    d = a.decide(signals(3, inflight=4), 50.0)
    assert d.changed and d.desired == 2  # 4 / 0.9 -> 2 at target less the tolerance


def test_idle_goes_to_zero_and_a_waiting_request_comes_back_at_once():
    a = Autoscaler(CFG, 0, 4, idle_to_zero_s=30)
    assert not a.decide(signals(1, idle=10), 0.0).changed
    assert a.decide(signals(1, idle=31), 1.0).desired == 0
    d = a.decide(signals(0, queued=1), 2.0)
    assert d.changed and d.desired == 1 and d.signal == "cold_start"
    assert a.decide(signals(0, queued=9), 3.0).desired == 3  # at target from the start: 9 / 4
    assert Autoscaler(CFG, 2, 4, None).decide(signals(0), 0.0).desired == 2  # the floor holds


def test_fleet_config_takes_models_and_their_autoscaling(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(
        '[[models]]\nname = "a"\nmin_replicas = 0\nmax_replicas = 3\nwarm_standby = 1\n'
        "[models.autoscale]\ntarget_inflight = 2.5\n"
        '[[models]]\nname = "b"\n'
    )
    cfg = load_fleet_config(path)
    a, b = cfg.model_configs()
    assert (a.name, a.min_replicas, a.max_replicas, a.warm_standby) == ("a", 0, 3, 1)
    assert a.autoscale.target_inflight == 2.5 and b.autoscale.target_inflight == 8.0
    path.write_text('[[models]]\nname = "a"\nmin_replicas = 3\nmax_replicas = 2\n')
    with pytest.raises(ValueError, match="min_replicas"):
        load_fleet_config(path)


# --- a real fleet --------------------------------------------------------------------------

REPLICA_ARGS = '["--threads", "1", "--kv-cache-memory", "256MiB"]'
FLEET = f"""
[[models]]
name = "a"
replica_args = {REPLICA_ARGS}
min_replicas = 0
max_replicas = 2
warm_standby = 1
scale_to_zero_after_s = 3
[models.autoscale]
target_inflight = 2
scale_up_delay_s = 0.3
scale_down_delay_s = 1.5

[[models]]
name = "b"
replica_args = {REPLICA_ARGS}
min_replicas = 0
max_replicas = 1
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    path = tmp_path_factory.mktemp("fleet") / "fleet.toml"
    path.write_text(FLEET)
    gw = spawn(["fleet", "up", "--config", str(path), "--base-port", "0"])
    try:
        wait_until(gw, lambda: states(gw, "a") == ["standby"], 240)
        yield gw
    finally:
        gw.stop()


def pools(gw) -> dict[str, dict]:
    return {p["pool"]: p for p in gw.get("/replicas").json()["pools"]}


def states(gw, pool: str) -> list[str]:
    return sorted(pools(gw)[pool]["replicas"].values())


def ask(gw, model: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(gw.url + "/v1/completions", json=body, timeout=240)


def test_requests_are_routed_by_model_and_an_unknown_one_is_404(fleet):
    ids = {m["id"] for m in fleet.get("/v1/models").json()["data"]}
    assert {"a", "b"} <= ids  # listed though neither has an active replica
    r = ask(fleet, "c")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert states(fleet, "b") == []  # no process for a model nobody asked for


def test_a_warm_standby_takes_the_first_request_within_a_second(fleet):
    t0 = time.monotonic()
    r = ask(fleet, "a", max_tokens=1)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert took < 1.0, took  # promoted, not started
    assert r.headers["x-replica"] in pools(fleet)["a"]["replicas"]
    wait_until(fleet, lambda: "starting" in states(fleet, "a") or states(fleet, "a").count("standby"), 10)
    wait_until(fleet, lambda: "standby" in states(fleet, "a"), 240)  # the pool refilled behind it


def test_a_model_at_zero_starts_a_replica_for_its_next_request(fleet):
    t0 = time.monotonic()
    r = ask(fleet, "b")
    assert r.status_code == 200, r.text  # it waited, it was not refused
    assert time.monotonic() - t0 > 1.0  # a process really started for it
    assert metric(fleet.url, 'shoal:gateway_cold_start_wait_seconds_count{model="b"}') == 1
    assert states(fleet, "b") == ["ready"]


def test_a_burst_scales_up_and_idleness_back_to_zero_without_a_failure(fleet):
    async def burst():
        async with httpx.AsyncClient(timeout=240) as c:
            body = {"model": "a", "prompt": "Once upon a time", "max_tokens": 96, "ignore_eos": True}
            return await asyncio.gather(*(c.post(fleet.url + "/v1/completions", json=body) for _ in range(8)))

    seen = set()

    async def watch(task):
        while not task.done():
            seen.add(pools(fleet)["a"]["desired"])
            await asyncio.sleep(0.2)

    async def run():
        task = asyncio.create_task(burst())
        await watch(task)
        return await task

    answers = asyncio.run(run())
    assert [r.status_code for r in answers] == [200] * 8
    assert max(seen) == 2, seen
    # Idle: down to no active replica (the standby stays loaded), through draining, not kills.
    wait_until(fleet, lambda: "ready" not in states(fleet, "a") and "draining" not in states(fleet, "a"), 60)
    assert "standby" in states(fleet, "a")
    decisions = [
        line
        for line in fleet.get("/metrics").text.splitlines()
        if line.startswith("shoal:gateway_autoscaler_decisions_total{") and 'pool="a"' in line
    ]
    assert any('direction="up"' in d for d in decisions), decisions  # from zero, straight to 2
    assert any('direction="down"' in d and 'signal="idle"' in d for d in decisions), decisions
    assert metric(fleet.url, 'shoal:gateway_responses_total{status="503"}') == 0


def test_a_canary_takes_its_share_of_requests():
    from shoal.fleet.admission.canary import CanarySplit
    from shoal.fleet.replicas.replica import Replica

    canary = CanarySplit()
    old = [Replica(f"r{i}", f"http://r{i}", version=0) for i in range(3)]
    new = Replica("r3", "http://r3", version=1)
    free = [*old, new]
    assert canary.split(None, free) == free  # no canary: every replica
    canary.start(None, 1, 0.2)
    picks = [canary.split(None, free) for _ in range(2000)]
    share = sum(p == [new] for p in picks) / len(picks)
    assert 0.15 < share < 0.25 and all(p in ([new], old) for p in picks)
    assert canary.split(None, old) == old  # the canary busy or gone: the rest serve


def test_an_idle_model_is_unloaded_when_memory_is_short(tmp_path):
    """A node budget that holds one replica: asking for the second model unloads the idle first."""
    path = tmp_path / "fleet.toml"
    one = f"replica_args = {REPLICA_ARGS}\nmin_replicas = 0\nmax_replicas = 1\nmemory_mb = 1000\n"
    path.write_text(f'memory_budget_mb = 1500\n[[models]]\nname = "a"\n{one}[[models]]\nname = "b"\n{one}')
    gw = spawn(["fleet", "up", "--config", str(path), "--base-port", "0"])
    try:
        wait_until(gw, lambda: gw.get("/ready").status_code == 200, 60)
        assert ask(gw, "a").status_code == 200
        assert states(gw, "a") == ["ready"]
        r = ask(gw, "b")  # waits while a (idle now) is unloaded and b starts
        assert r.status_code == 200, r.text
        assert states(gw, "b") == ["ready"] and states(gw, "a") == []
        assert pools(gw)["a"]["unloaded"]
        assert metric(gw.url, 'shoal:gateway_model_unloads_total{pool="a"}') == 1
        assert ask(gw, "a").status_code == 200  # and back: now b, idle, makes room
        assert states(gw, "a") == ["ready"] and states(gw, "b") == []
    finally:
        gw.stop()


def test_a_fleet_from_flags_at_zero_lists_its_model():
    """`shoal fleet up --min-replicas 0`: no replica runs, and /v1/models still names the model, so
    that a client can find what to ask for (and its request wakes it)."""
    gw = spawn(["fleet", "up", "--min-replicas", "0", "--max-replicas", "1", "--base-port", "0"])
    try:
        wait_until(gw, lambda: gw.get("/ready").status_code == 200, 60)
        assert gw.get("/replicas").json()["replicas"] == []
        ids = [m["id"] for m in gw.get("/v1/models").json()["data"]]
        assert ids == [BUNDLED_NAME], ids
    finally:
        gw.stop()


def test_the_status_page_shows_the_fleet_in_a_real_browser(fleet):
    """Headless Chromium loads /status: the pools, every replica with its lifecycle, the chart and
    the autoscaler's decisions, as /fleet/state says."""
    playwright = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no Chromium here (Debian: apt-get install chromium)")
    state = fleet.get("/fleet/state").json()
    assert state["decisions"] and state["history"]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(fleet.url + "/status")
            page.wait_for_selector("#replicas tbody tr", timeout=15_000)
            page.wait_for_selector("#chart path", timeout=15_000)
            names = page.eval_on_selector_all(
                "#replicas tbody tr", "rows => rows.map(r => r.dataset.replica)"
            )
            assert sorted(names) == sorted(r["name"] for r in fleet.get("/replicas").json()["replicas"])
            assert set(page.eval_on_selector_all(".pool", "ps => ps.map(p => p.dataset.pool)")) == {"a", "b"}
            assert "standby" in page.inner_text("#replicas")
            assert "cold start" in page.inner_text("#decisions")
            assert page.inner_text("#error") == ""
        finally:
            browser.close()
