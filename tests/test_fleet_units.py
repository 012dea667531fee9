"""Fleet logic on its own: prefix index, policies, circuit breaker, config file, poison strikes,
restart backoff, stream continuation bookkeeping."""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

import pytest

from shoal.fleet.admission.usage_store import state_dir
from shoal.fleet.config import FleetConfig, load_fleet_config
from shoal.fleet.control.launchers.local import port_in_use
from shoal.fleet.control.replica_set import ReplicaSet, Slot
from shoal.fleet.proxy.poison import PoisonGuard, crashed, fingerprint
from shoal.fleet.proxy.stream_state import ORIGINAL, StreamState
from shoal.fleet.replicas.prefix_index import PrefixIndex
from shoal.fleet.replicas.replica import Death, Health, Replica
from shoal.fleet.routing.policies import KVAware, RouteRequest, Session
from shoal.protocol.block_hash import hash_blocks


def ready(name: str, inflight: int = 0) -> Replica:
    r = Replica(name, f"http://{name}", state=Health.READY)
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
    assert r.state == Health.EJECTED and not r.routable(time.monotonic())
    time.sleep(0.06)
    assert r.routable(time.monotonic()) and r.state == Health.HALF_OPEN
    r.on_dispatch()
    assert not r.routable(time.monotonic())  # one trial at a time
    r.on_success()
    assert r.state == Health.READY


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


# --- failure handling -------------------------------------------------------------------------


class _Attempt:
    def __init__(self, tokens: int = 0):
        self.tokens = tokens


def test_a_gateways_state_goes_where_it_is_configured_else_under_the_state_root(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))
    assert state_dir(None, 8123) == tmp_path / "state" / "gateway-8123"  # one folder a port
    assert state_dir(str(tmp_path / "mine"), 8123) == tmp_path / "mine"
    monkeypatch.delenv("SHOAL_STATE_DIR")
    assert state_dir(None, 8123) == tmp_path / "cache" / "gateway-8123"
    monkeypatch.setenv("SHOAL_NO_CACHE", "1")
    assert state_dir(None, 8123) is None  # the gateway then keeps it in a temporary folder


def test_a_kill_costs_one_strike_and_a_second_death_convicts():
    guard = PoisonGuard(ttl_s=60)
    a = _Attempt(tokens=5)
    killed = Death(0.0, "kill -9", frozenset({a}), exit_code=-9)
    assert not crashed(killed, reported_engine_dead=False)
    assert not guard.judge("fp", killed, a, engine_dead=False)  # continued once
    b = _Attempt(tokens=3)  # the same prompt sent twice, both on the replica that was killed
    assert not guard.judge("fp", killed, b, engine_dead=False)  # one death, one strike
    assert not guard.refused("fp")
    assert guard.judge("fp", Death(1.0, "frozen", frozenset({a})), a, engine_dead=False)
    assert guard.refused("fp") > 0
    assert not guard.refused("other")


def test_a_crash_convicts_at_once_only_its_prime_suspect():
    guard = PoisonGuard(ttl_s=60)
    alone = _Attempt()
    assert guard.judge("p1", Death(0.0, "engine", frozenset({alone})), alone, engine_dead=True)
    fresh, running = _Attempt(0), _Attempt(40)
    crash = Death(0.0, "exit 3", frozenset({fresh, running}), exit_code=3)
    assert crashed(crash, reported_engine_dead=False)
    assert guard.judge("p2", crash, fresh, engine_dead=False)  # the only one without a token yet
    assert not guard.judge("p3", crash, running, engine_dead=False)  # a bystander: continued
    two_fresh = Death(0.0, "segv", frozenset({_Attempt(0), fresh}), exit_code=-11)
    assert not guard.judge("p4", two_fresh, fresh, engine_dead=False)  # not sure which: once more


def test_strikes_expire():
    guard = PoisonGuard(ttl_s=0.05)
    a = _Attempt()
    guard.convict("fp")
    assert guard.refused("fp") and guard.active
    time.sleep(0.06)
    assert not guard.refused("fp") and not guard.active
    assert not guard.judge("fp", Death(0.0, "kill", frozenset({a}), -9), a, engine_dead=False)


def test_fingerprints_ignore_how_the_answer_streams():
    body = {"model": "m", "prompt": "x", "max_tokens": 3}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    assert fingerprint("/v1/completions", body) == fingerprint("/v1/completions", streamed)
    assert fingerprint("/v1/completions", body) != fingerprint("/v1/completions", {**body, "max_tokens": 4})
    assert fingerprint("/v1/completions", body) != fingerprint("/v1/chat/completions", body)


def test_restarts_back_off_exponentially_and_reset_after_a_good_run():
    replica_set = SimpleNamespace(
        config=FleetConfig(restart_backoff_s=1.0, restart_backoff_max_s=8.0, restart_reset_after_s=60.0)
    )
    r = Slot("replica-0", None, 1, "/dev/null", started_at=100.0)
    delays = [ReplicaSet._backoff(replica_set, r, 101.0) for _ in range(5)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0]
    r.started_at = 100.0
    assert ReplicaSet._backoff(replica_set, r, 200.0) == 1.0  # it had stayed up 100 s


def test_a_listening_port_is_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        assert port_in_use(port)
    assert not port_in_use(port)


def test_a_profilers_timed_gateway_keeps_its_state_in_a_folder_gone_with_it(
    chat_server, tmp_path, monkeypatch
):
    """The profiler's calibration gateway runs on a port of the moment: its batch and usage state
    goes to a folder of its own, not a `gateway-<port>` folder left in the state root."""
    import httpx

    from shoal.sim.servers import running

    root = tmp_path / "root"
    monkeypatch.setenv("SHOAL_STATE_DIR", str(root))
    with running(["gateway", "--backend", chat_server.url]) as (url, _):
        assert httpx.get(url + "/ready", timeout=10).status_code == 200
    assert not root.exists() or not any(root.iterdir())


def test_stream_state_resumes_each_choice_and_merges_the_answers():
    body = {"model": "m", "prompt": "Hi", "n": 2, "best_of": 2, "stream": True, "logprobs": 1}
    body["stream_options"] = {"include_usage": True}
    st = StreamState("/v1/completions", body)
    head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}

    def chunk(i, text, ids, offsets, **extra):
        lp = {"tokens": ["t"] * len(ids), "token_logprobs": [-0.5] * len(ids), "top_logprobs": None}
        lp["text_offset"] = offsets
        return {**head, "choices": [{"index": i, "text": text, "logprobs": lp, "token_ids": ids, **extra}]}

    out, n = st.relay(ORIGINAL, chunk(0, "Hel", [5, 6], [0, 2], prompt_token_ids=[1, 2]))
    assert n == 2 and "token_ids" not in out["choices"][0] and "prompt_token_ids" not in out["choices"][0]
    st.relay(ORIGINAL, chunk(1, "Yo", [9], [0], prompt_token_ids=[1, 2]))
    st.relay(ORIGINAL, chunk(0, "lo", [7], [3], finish_reason="length"))
    assert st.unfinished == [1]
    resumed, tag = st.resume_body(1, st.prompt_ids_for(1))
    want = {"prompt_token_ids": [1, 2], "output_token_ids": [9], "index": 1, "text_offset": 2}
    assert resumed["resume"] == want
    assert "n" not in resumed and "best_of" not in resumed and resumed["return_token_ids"] is True
    other = {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m"}
    late = {**other, "choices": [{**chunk(1, "!", [4], [0])["choices"][0], "prompt_token_ids": [1, 2]}]}
    out, _ = st.relay(tag, late)
    assert out["id"] == "cmpl-1" and out["created"] == 7 and out["choices"][0]["index"] == 1
    assert out["choices"][0]["logprobs"]["text_offset"] == [2]  # after the 2 characters sent before
    assert "prompt_token_ids" not in out["choices"][0]
    usage = {**other, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}}
    assert st.relay(tag, usage)[0] is None  # one choice's usage: the gateway sums its own
    st.relay(tag, {**other, "choices": [{"index": 1, "text": "", "logprobs": None, "finish_reason": "stop"}]})
    assert st.all_finished
    final = st.final_usage()
    assert final["id"] == "cmpl-1" and final["usage"]["prompt_tokens"] == 2
    assert final["usage"]["completion_tokens"] == 5 and final["usage"]["total_tokens"] == 7


def test_the_gateway_renders_chat_prompts_with_the_replicas_tool_format():
    """Tools offered in a chat request are rendered into the prompt in the replicas' tool format
    (their --tool-call-parser), by the server's own function: the gateway's hashes are theirs."""
    from shoal.fleet.gateway import Gateway
    from shoal.models.chat_prompt import chat_token_ids, raw_messages
    from shoal.models.tool_formats import HERMES, SMOLLM2, offered_tools

    fleet = FleetConfig(replica_args=["--tool-call-parser", "hermes"])
    gw = Gateway(fleet.gateway, fleet)
    asyncio.run(gw.keys.start())
    body = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
    }
    ids = gw.keys.prompt_ids("/v1/chat/completions", body)
    tok, messages, tools = gw.keys.tokenizer, raw_messages(body["messages"]), offered_tools(body)
    assert ids == chat_token_ids(tok, messages, tools, HERMES)
    assert ids != chat_token_ids(tok, messages, tools, SMOLLM2)  # what "auto" renders for this model


def test_a_partition_that_ends_with_the_same_process_back_withdraws_its_strikes():
    guard, a, b = PoisonGuard(600), _Attempt(3), _Attempt(5)
    cut = Death(0.0, "probe: ConnectTimeout 3 times", frozenset({a, b}), unreachable=True)
    assert not guard.judge("fp", cut, a, engine_dead=False)  # one strike: continued elsewhere
    guard.absolve(cut)  # the replica came back as the same process
    killed = Death(1.0, "kill -9", frozenset({a}), exit_code=-9)
    assert not guard.judge("fp", killed, a, engine_dead=False)  # its first real death: continued
    again = Death(2.0, "kill -9", frozenset({a}), exit_code=-9)
    assert guard.judge("fp", again, a, engine_dead=False)  # a second real one convicts
    guard.absolve(again)  # a conviction stands
    assert guard.refused("fp") > 0


def test_a_store_url_is_shown_without_its_password():
    from shoal.fleet.admission.store import shown

    assert shown("redis://:s3cret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert shown("redis://user:pw@cache/1") == "redis://user:***@cache/1"
    assert shown("rediss://:x@[::1]:6380") == "rediss://:***@[::1]:6380"
    assert shown("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"  # nothing to hide
