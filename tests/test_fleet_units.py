"""Routing logic on its own: prefix index, policies, circuit breaker, config file."""

from __future__ import annotations

import time

import pytest

from shoal.fleet.config import load_fleet_config
from shoal.fleet.policies import KVAware, RouteRequest, Session
from shoal.fleet.prefix_index import PrefixIndex
from shoal.fleet.replica import Replica, ReplicaState
from shoal.protocol.block_hash import hash_blocks


def ready(name: str, inflight: int = 0) -> Replica:
    r = Replica(name, f"http://{name}", state=ReplicaState.READY)
    r.inflight = inflight
    return r


def test_index_counts_leading_blocks_and_forgets_on_removal_and_reset():
    idx = PrefixIndex(max_blocks_per_replica=100)
    h = hash_blocks(list(range(64)), 16)
    for x in h[:3]:
        idx.stored("a", x)
    idx.routed("b", h[:1])
    assert idx.matched_blocks(h, ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    idx.removed("a", h[1])
    assert idx.matched_blocks(h, ["a"]) == {"a": 1}  # a gap ends the usable prefix
    idx.reset("a")
    assert idx.size("a") == 0


def test_index_is_bounded_per_replica():
    idx = PrefixIndex(max_blocks_per_replica=4)
    idx.routed("a", list(range(10)))
    assert idx.size("a") == 4 and idx.matched_blocks([6, 7, 8, 9], ["a"]) == {"a": 4}


def test_kv_aware_prefers_cached_prefix_until_load_outweighs_it():
    idx = PrefixIndex()
    hashes = hash_blocks(list(range(16 * 20)), 16)
    idx.routed("a", hashes)
    policy = KVAware(idx, load_weight=8.0, imbalance_limit=16)
    a, b = ready("a", inflight=1), ready("b")
    assert policy.choose([a, b], RouteRequest(hashes))[0] is a  # 0 + 8 < 20
    a.inflight = 3
    assert policy.choose([a, b], RouteRequest(hashes))[0] is b  # 24 > 20
    a.inflight = 20
    chosen, reason = policy.choose([a, b], RouteRequest(hashes))
    assert chosen is b and reason == "imbalance_fallback"


def test_session_sticks_and_moves_only_when_its_replica_is_gone():
    reps = [ready(n) for n in "abcd"]
    policy = Session()
    home = policy.choose(reps, RouteRequest(session="s1"))[0]
    assert all(policy.choose(reps, RouteRequest(session="s1"))[0] is home for _ in range(5))
    others = [r for r in reps if r is not home]
    fallback = policy.choose(others, RouteRequest(session="s1"))[0]
    assert fallback in others


def test_circuit_breaker_opens_then_half_opens_then_closes():
    r = ready("a")
    for _ in range(2):
        r.on_dispatch()
        assert not r.on_failure("HTTP 500", eject_after=3, eject_for=0.05)
    r.on_dispatch()
    assert r.on_failure("HTTP 500", eject_after=3, eject_for=0.05)
    assert r.state == ReplicaState.EJECTED and not r.routable(time.monotonic())
    time.sleep(0.06)
    assert r.routable(time.monotonic()) and r.state == ReplicaState.HALF_OPEN
    r.on_dispatch()
    assert not r.routable(time.monotonic())  # one trial at a time
    r.on_success()
    assert r.state == ReplicaState.READY


def test_fleet_config_file(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(
        'replicas = 3\nreplica_args = ["--threads", "1"]\n[gateway]\npolicy = "session"\nmax_queue = 7\n'
    )
    cfg = load_fleet_config(path)
    assert cfg.replicas == 3 and cfg.replica_args == ["--threads", "1"]
    assert cfg.gateway.policy == "session" and cfg.gateway.max_queue == 7
    path.write_text('[gateway]\npolicy = "random"\n')
    with pytest.raises(ValueError, match="unknown policy"):
        load_fleet_config(path)
    path.write_text("replicaz = 3\n")
    with pytest.raises(ValueError, match="replicaz"):
        load_fleet_config(path)
