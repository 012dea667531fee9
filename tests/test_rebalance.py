"""Rebalancing by live migration: the rule on /load answers, and two real replicas of the bundled
model whose gateway pins every request of one session to one of them (the session policy).

With four seats a replica (--max-num-seqs 4) and eight streams of one session, half of them wait
in the hot replica's engine while the other replica idles; the rebalancer moves running streams
to it, the waiting ones start, and every stream is exactly what it is unmoved."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from shoal.fleet.config import GatewayConfig
from shoal.fleet.control.rebalancer import Move, plan_moves
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.proxy.upstream import Attempt
from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.replica import Health, Replica
from shoal.fleet.replicas.table import ReplicaTable
from shoal.protocol.secrets import KV_TRANSFER_KEY_ENV
from tests.fleet_helpers import auth, metric, start_gateway
from tests.server_helpers import sse_objects, start_servers

KEY = "sk-rebalance"
MODEL = "SmolLM2-135M-Instruct"


def replica(name: str, model: str = "m", **load) -> Replica:
    r = Replica(name, f"http://{name}", state=Health.READY, model=model)
    r.load = {"running": 0, "waiting": 0, "kv_usage": 0.0, "max_num_seqs": 8, **load}
    return r


def test_the_rule_moves_half_the_gap_from_a_queued_or_full_replica_to_one_with_room():
    cfg = GatewayConfig(rebalance_max_moves=4)
    queued = replica("a", running=8, waiting=3, kv_usage=0.5)
    idle = replica("b", running=2, kv_usage=0.2)
    assert plan_moves([queued, idle], cfg) == [Move("a", 3, "queued")]
    # A request waiting while seats are free is about to run: not a queue to move streams for.
    assert plan_moves([replica("a", running=5, waiting=1), idle], cfg) == []
    full = replica("a", running=6, kv_usage=0.95)
    assert plan_moves([full, idle], cfg) == [Move("a", 2, "kv_full")]
    # Nowhere to go: the other has a queue, a fuller cache, no seat; or is another model's.
    for other in (
        replica("b", running=1, waiting=1),
        replica("b", running=1, kv_usage=0.7),
        replica("b", running=8, kv_usage=0.1),
        replica("b", model="other"),
    ):
        assert plan_moves([queued, other], cfg) == []
    # A replica out of routing neither gives nor takes.
    down = replica("b")
    down.state = Health.DOWN
    assert plan_moves([queued, down], cfg) == []
    # At most max_moves a round, and no more than the others have room for.
    assert plan_moves([replica("a", running=40, waiting=9), idle], cfg) == [Move("a", 4, "queued")]
    assert plan_moves([queued, replica("b", running=7)], cfg) == [Move("a", 1, "queued")]


def test_a_busy_replica_moves_its_least_urgent_then_longest_streams_first():
    table = ReplicaTable(PrefixIndex(), GatewayMetrics(), 16)
    hot, other = (table.add(name, f"http://{name}") for name in ("hot", "other"))
    hot.state = other.state = Health.READY
    asked = []
    streams = {}
    for name, priority, tokens in [("chat", 0, 500), ("batch-short", 100, 10), ("batch-long", 100, 90)]:
        a = streams[name] = Attempt(hot, priority)
        a.tokens, a.movable = tokens, True
        a.on_move = lambda name=name: asked.append(name)
    Attempt(hot).on_move = lambda: asked.append("unmovable")  # its tokens are not known exactly
    assert table.move_streams("hot", 2) == 2
    assert asked == ["batch-long", "batch-short"]
    assert table.move_streams("hot", 2) == 1  # the two already moving are not asked again
    assert asked[-1] == "chat"
    other.state = Health.DOWN  # no replica left to take them: none moves
    streams["chat"].move_asked = False
    assert table.move_streams("hot") == 0


@pytest.fixture(scope="module")
def pinned_fleet():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KV_TRANSFER_KEY_ENV, "rebalance-transfer-key")
        args = ("--api-key", KEY, "--kv-cache-memory", "128MiB", "--threads", "1", "--max-num-seqs", "4")
        reps = start_servers(list(args), list(args))
        gw = None
        try:
            gw = start_gateway([r.url for r in reps], "--policy", "session", "--rebalance", api_key=KEY)
            yield gw, reps
        finally:
            for p in [gw, *reps]:
                if p is not None:
                    p.stop()


def stream(url: str, i: int) -> tuple[list[int], str]:
    body = {
        "model": MODEL,
        "prompt": f"Harbour log, entry {i}: the tide came in over the rocks and",
        "max_tokens": 64,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    headers = {**auth(KEY), "x-session-id": "one-busy-session"}
    ids, text = [], ""
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for obj in sse_objects(r):
            assert "error" not in obj, obj
            for ch in obj.get("choices") or []:
                ids += ch.get("token_ids") or []
                text += ch.get("text") or ""
    return ids, text


def test_streams_pinned_to_one_replica_move_to_the_idle_one_and_stay_exact(pinned_fleet):
    gw, reps = pinned_fleet
    wants = [stream(gw.url, i) for i in range(8)]  # one at a time: nothing queues, nothing moves
    assert metric(gw.url, "shoal:gateway_rebalance_moves_total") == 0
    served = [metric(r.url, "shoal:generation_tokens_total") for r in reps]
    assert min(served) == 0  # one session: one replica served them all
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: stream(gw.url, i), range(8)))
    assert got == wants
    moved = metric(gw.url, 'shoal:gateway_rebalance_moves_total{reason="queued"')
    assert moved >= 1
    assert metric(gw.url, 'shoal:gateway_migrations_total{outcome="ok"') >= 1
    assert metric(gw.url, "shoal:gateway_failovers_total") == 0
    idle = served.index(0)
    assert metric(reps[idle].url, "shoal:generation_tokens_total") > 0  # the idle one took some
    for r in reps:
        r.wait_idle()
