"""Tenants, rate limits, the fair queue and the tiers rules, without a model: keys map to tenants,
limits refuse with OpenAI's 429 and headers, a client cannot raise its priority, and waiting
requests are served by priority, then by each tenant's weighted share of tokens served."""

from __future__ import annotations

import hashlib

import pytest

from shoal.fleet.admission.fair_queue import FairQueue, Waiter
from shoal.fleet.admission.tenants import TenantConfig, Tenants, TokenBucket, key_digest
from shoal.fleet.admission.usage_store import UsageStore
from shoal.fleet.config import load_fleet_config
from shoal.fleet.routing.tiers import TierConfig, TierRouter, confidence
from shoal.protocol.errors import APIError


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def tenants(clock, **limits) -> Tenants:
    cfg = TenantConfig("acme", api_key_sha256=key_digest("sk-acme"), burst_s=60, **limits)
    other = TenantConfig("zen", api_key_sha256=key_digest("sk-zen"), priority=2, models=["small"])
    return Tenants([cfg, other], operator_key="sk-op", clock=clock)


def test_keys_map_to_tenants_and_unknown_keys_are_refused():
    t = tenants(Clock())
    assert t.authenticate("Bearer sk-acme").name == "acme"
    assert t.authenticate("bearer sk-zen").name == "zen"
    assert t.authenticate("Bearer sk-op").name == "operator"
    for bad in ("", "Bearer", "Bearer sk-nope", "Basic sk-acme", "sk-acme"):
        with pytest.raises(APIError) as err:
            t.authenticate(bad)
        assert err.value.status == 401 and err.value.body()["error"]["code"] == "invalid_api_key"


def test_keys_come_from_a_hash_an_environment_variable_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ACME_KEY", "sk-env")
    (tmp_path / "key").write_text("sk-file\n")
    path = tmp_path / "fleet.toml"
    digest = hashlib.sha256(b"sk-hash").hexdigest()
    path.write_text(
        f"""
[[tenants]]
name = "a"
api_key_sha256 = "{digest}"
[[tenants]]
name = "b"
api_key_env = "ACME_KEY"
[[tenants]]
name = "c"
api_key_file = "{tmp_path / "key"}"
requests_per_minute = 5
"""
    )
    cfg = load_fleet_config(path).gateway
    t = Tenants(cfg.tenants, None)
    assert [t.authenticate(f"Bearer {k}").name for k in ("sk-hash", "sk-env", "sk-file")] == ["a", "b", "c"]
    assert "sk-env" not in repr(cfg) and "sk-file" not in repr(cfg)  # only where to find them
    monkeypatch.delenv("ACME_KEY")
    with pytest.raises(ValueError, match="ACME_KEY"):
        load_fleet_config(path)
    path.write_text('[[tenants]]\nname = "x"\napi_key_sha256 = "abc"\n')
    with pytest.raises(ValueError, match="SHA-256"):
        load_fleet_config(path)
    path.write_text(f'[[tenants]]\nname = "x"\napi_key_sha256 = "{digest}"\npriority = 100\n')
    with pytest.raises(ValueError, match="batch_priority"):
        load_fleet_config(path)


def test_requests_per_minute_refuse_with_retry_after_and_ratelimit_headers():
    clock = Clock()
    t = tenants(clock, requests_per_minute=2)
    acme = t.authenticate("Bearer sk-acme")
    a = t.admit(acme, None, 10)
    t.admit(acme, None, 10)
    assert acme.rate_headers()["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(APIError) as err:
        t.admit(acme, None, 10)
    e = err.value
    assert e.status == 429 and e.body()["error"]["type"] == "rate_limit_error"
    assert e.headers["Retry-After"] == "30"  # one request of two per minute comes back in 30 s
    assert (
        e.headers["x-ratelimit-limit-requests"] == "2" and e.headers["x-ratelimit-reset-requests"] == "1m0s"
    )
    a.settle()
    clock.t += 30
    t.admit(acme, None, 10)  # refilled
    assert acme.lane_usage("interactive").rate_limited == 1


def test_tokens_per_minute_are_charged_up_front_and_corrected_to_what_was_used():
    clock = Clock()
    t = tenants(clock, tokens_per_minute=1000)
    acme = t.authenticate("Bearer sk-acme")
    ticket = t.admit(acme, None, 900)
    with pytest.raises(APIError) as err:
        t.admit(acme, None, 200)  # 100 left
    assert err.value.headers["x-ratelimit-remaining-tokens"] == "100"
    assert err.value.headers["Retry-After"] == "6"  # 100 more tokens take 6 s at 1000 a minute
    ticket.record(50, 50)
    ticket.settle()  # used 100 of the 900 charged: 800 back
    t.admit(acme, None, 800)
    assert acme.lane_usage("interactive").prompt_tokens == 50


def test_concurrency_cap_and_models_a_tenant_may_use():
    t = tenants(Clock(), max_concurrency=1)
    acme, zen = t.authenticate("Bearer sk-acme"), t.authenticate("Bearer sk-zen")
    ticket = t.admit(acme, "anything", 1)
    with pytest.raises(APIError) as err:
        t.admit(acme, "anything", 1)
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
    ticket.settle()
    ticket.settle()  # once only
    assert acme.inflight == 0
    t.admit(zen, "small", 1)
    with pytest.raises(APIError) as err:
        t.admit(zen, "large", 1)
    assert err.value.status == 404 and err.value.body()["error"]["code"] == "model_not_found"


def test_a_client_can_lower_its_priority_but_never_raise_it():
    zen = tenants(Clock()).authenticate("Bearer sk-zen")  # class 2
    assert zen.priority_for(None) == 2
    assert zen.priority_for(-100) == 2
    assert zen.priority_for(0) == 2
    assert zen.priority_for(7) == 7
    assert zen.priority_for(True) == 2 and zen.priority_for("0") == 2


def test_a_bucket_holds_its_burst_and_at_least_one():
    clock = Clock()
    b = TokenBucket(120, burst_s=10, clock=clock)  # 2 a second, 20 at once
    b.take(20)
    assert b.wait_for(1) == pytest.approx(0.5) and b.reset_s() == pytest.approx(10)
    slow = TokenBucket(2, burst_s=10, clock=clock)  # a third of a request's worth: one
    assert slow.wait_for(1) == 0
    slow.take(1)
    assert slow.wait_for(1) == pytest.approx(30)


def test_a_bucket_in_debt_makes_later_requests_wait():
    clock = Clock()
    b = TokenBucket(600, clock=clock)
    b.take(900)  # used more than it had
    assert b.wait_for(1) == pytest.approx(30.1)
    clock.t += 31
    assert b.wait_for(1) == 0


def waiters(q: FairQueue, model, tenant, n, priority=0):
    out = [Waiter(model, tenant, priority) for _ in range(n)]
    for w in out:
        q.join(w)
    return out


def test_the_fair_queue_serves_the_tenant_with_least_service_first():
    q = FairQueue()
    flood = waiters(q, None, "flood", 5)
    q.charge("flood", 500)  # it has been served a lot already
    other = waiters(q, None, "other", 2)
    assert q.counters["other"] == 500  # lifted to the flood's: idling earned it nothing
    assert not q.in_turn(other[0], 1) and q.in_turn(other[0], 2)  # equal: the older flood request first
    q.leave(flood[0])
    q.charge("flood", 100)  # that request was served
    assert list(q.order(None))[:3] == [other[0], flood[1], other[1]]  # then turns, not 4 floods
    assert not q.in_turn(flood[1], 1) and q.in_turn(other[0], 1)


def test_weights_and_priorities_order_the_queue():
    q = FairQueue()
    q.weights.update({"gold": 4.0, "tin": 1.0})
    batch = waiters(q, None, "gold", 1, priority=100)
    tin, gold = waiters(q, None, "tin", 1), waiters(q, None, "gold", 1)
    q.charge("gold", 400)  # 100 after its weight
    q.charge("tin", 200)
    assert list(q.order(None)) == [gold[0], tin[0], batch[0]]
    assert q.waiting_below(None, 100) == 2 and q.waiting(None) == 3 and q.waiting("other") == 0


def test_a_tenant_that_waits_again_joins_within_the_waiting_counters():
    q = FairQueue()
    waiters(q, None, "busy", 1)
    q.charge("busy", 1000)
    q.charge("idle", 10)
    waiters(q, None, "idle", 1)
    assert q.counters["idle"] == 1000  # no credit banked while away
    assert [w.tenant for w in q.order(None)] == ["busy", "idle"]  # equal: the earlier first
    q.charge("alone", 5000)  # served while no one else wanted anything
    waiters(q, None, "alone", 1)
    assert q.counters["alone"] == 1000  # that is no debt once others wait


def test_usage_totals_survive_the_store(tmp_path):
    t = tenants(Clock())
    acme = t.authenticate("Bearer sk-acme")
    ticket = t.admit(acme, None, 10)
    ticket.record(7, 3)
    ticket.settle()
    store = UsageStore(tmp_path / "usage.sqlite3")
    store.write(t.counts())
    store.close()
    again = UsageStore(tmp_path / "usage.sqlite3")
    total = again.totals(t.counts())[("acme", "interactive")]
    assert (total.requests, total.prompt_tokens, total.completion_tokens) == (2, 14, 6)  # stored + current


def test_tiers_confidence_and_first_choice():
    chat = {"choices": [{"logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.3}]}}]}
    assert confidence("/v1/chat/completions", chat) == pytest.approx(0.8187, abs=1e-3)
    comp = {"choices": [{"logprobs": {"token_logprobs": [-2.0]}}, {"logprobs": {"token_logprobs": [0.0]}}]}
    assert confidence("/v1/completions", comp) == pytest.approx(0.1353, abs=1e-3)  # the least sure
    assert confidence("/v1/completions", {"choices": [{"logprobs": None}]}) is None
    route = TierConfig("auto", "small", "large", max_prompt_tokens=100, min_confidence=0.5)
    router = TierRouter([route], metrics=None)
    assert router.first_choice(route, {}, {}, 50) == ("cheap", "default")
    assert router.first_choice(route, {}, {}, 500) == ("strong", "length")
    assert router.first_choice(route, {"tier": "cheap"}, {}, 500) == ("cheap", "hint")
    assert router.first_choice(route, {}, {"x-shoal-tier": "strong"}, 5) == ("strong", "hint")
    with pytest.raises(APIError):
        router.first_choice(route, {"tier": "best"}, {}, 5)
    # A tenant not allowed the strong model by name cannot ask for it; the rules still apply.
    assert router.first_choice(route, {"tier": "strong"}, {}, 5, may_ask_strong=False) == ("cheap", "default")


def test_a_full_queue_turns_away_the_tenant_that_holds_most_of_it():
    q = FairQueue()
    flood = waiters(q, None, "flood", 4) + waiters(q, "other-model", "flood", 1)
    waiters(q, None, "quiet", 1)
    victim = q.evict_for(Waiter(None, "quiet", 0))
    assert victim is flood[-1] and victim.evicted  # its newest, whichever model
    assert q.waiting("other-model") == 0 and q.waiting(None) == 5
    assert q.evict_for(Waiter(None, "flood", 0)) is None  # the flood itself is the one to turn away
    assert q.evict_for(Waiter(None, "quiet", 100)) is None  # a batch request displaces no one
    flood[3].bypass = True  # a continuation of a stream, admitted long ago
    assert q.evict_for(Waiter(None, "quiet", 0)) is flood[2]
    q2 = FairQueue()
    waiters(q2, None, "a", 2)
    waiters(q2, None, "b", 1)
    assert q2.evict_for(Waiter(None, "b", 0)) is None  # 2 against 1 + 1: even enough


def test_shares_decide_who_skips_the_queue_and_who_runs_after_its_class():
    from shoal.fleet.admission.shares import FairShares
    from shoal.fleet.config import GatewayConfig
    from shoal.fleet.metrics import GatewayMetrics
    from shoal.fleet.replicas.prefix_index import PrefixIndex
    from shoal.fleet.replicas.replica import Health, Replica
    from shoal.fleet.replicas.table import ReplicaTable
    from shoal.fleet.routing.policies import RouteRequest

    cfg = GatewayConfig(max_inflight_per_replica=4)
    table = ReplicaTable(PrefixIndex(), GatewayMetrics(), cfg.block_size)
    table.replicas["r0"] = Replica("r0", "http://r0", state=Health.READY)
    t = tenants(Clock())
    reg = FairShares(cfg, t, table)
    acme, zen = t.all["acme"], t.all["zen"]
    acme.inflight = 9
    assert not reg.over("acme", None)  # alone: no share to be past
    zen.inflight = 1
    assert reg.over("acme", None) and not reg.over("zen", None)  # 8 at most, 4 each
    assert reg.within(RouteRequest(tenant="zen"), 4)
    assert not reg.within(RouteRequest(tenant="zen", priority=cfg.batch_priority), 4)
    zen.inflight = 5
    assert reg.over("zen", None)
    zen.config.weight = 9.0  # a 90 % share: 7.2 of 8
    zen.inflight = 7
    assert not reg.over("zen", None) and reg.over("acme", None)
    cfg.fair_queuing = False
    assert not reg.over("acme", None)


def test_a_stream_without_token_ids_is_counted_from_its_usage_chunk():
    from shoal.fleet.proxy.stream_state import ORIGINAL, StreamState

    st = StreamState("/v1/completions", {"prompt": "x", "stream": True})
    head = {"id": "c", "created": 1, "model": "m"}
    st.relay(ORIGINAL, {**head, "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]})
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    out, _ = st.relay(ORIGINAL, {**head, "choices": [], "usage": usage})
    assert out is None  # the client did not ask for it: the gateway did, to count the tenant's tokens
    assert st.token_counts() == (5, 2)
