"""Blocks from peers and streams that move: two replicas of the bundled model behind a gateway
that alternates between them. A long prompt computed on one and then sent to the other is not
computed again there: the gateway sees (from the first one's KV events) that it holds the prefix
and has the second fetch those blocks from it over the K/V transport, and the answer is the one
the first gave. A fetch from a peer that does not hold the blocks leaves the replica to compute
the prompt, with the same answer; a fetch without the fleet's transfer key is refused. A stream
moved off its replica mid-generation (`/fleet/migrate`) goes on on the other one, its context
copied there while it went on decoding, and streams exactly what it would have: seeded sampling
with n=2 and logprobs (moved early, midway and late), a stop string, and a greedy chat under a
JSON grammar; one moved while its long prompt is computed starts again on the other."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shoal.protocol.secrets import KV_TRANSFER_KEY_ENV, KV_TRANSFER_KEY_HEADER
from tests.fleet_helpers import auth, metric, start_gateway, wait_until
from tests.server_helpers import sse_objects, start_servers

KEY = "sk-peer-fetch"
TRANSFER_KEY = "peer-fetch-transfer-key"
PROMPT = (
    "The lighthouse keeper wrote in his log every evening. " * 30
)  # 301 tokens: 18 full blocks before the last
ARGS = ("--api-key", KEY, "--kv-cache-memory", "128MiB", "--threads", "1")


@pytest.fixture(scope="module")
def fleet():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KV_TRANSFER_KEY_ENV, TRANSFER_KEY)
        reps = start_servers(list(ARGS), list(ARGS))
        gw = None
        try:
            gw = start_gateway([r.url for r in reps], "--policy", "round_robin", api_key=KEY)
            yield gw, reps
        finally:
            for p in [gw, *reps]:
                if p is not None:
                    p.stop()


def complete(url: str, prompt: str, headers: dict | None = None, **extra) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, headers=headers or auth(KEY), timeout=120)


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_replica_fetches_a_prefix_its_peer_holds_and_answers_as_the_peer_did(fleet):
    gw, (first, second) = fleet
    r = complete(gw.url, PROMPT)
    assert r.headers["x-replica"] == "backend-0"
    want = tokens(r)

    def indexed() -> bool:  # the first replica's KV events have reached the gateway
        reps = httpx.get(gw.url + "/replicas", headers=auth(KEY), timeout=5).json()["replicas"]
        return next(x for x in reps if x["name"] == "backend-0")["cached_blocks"] >= 18

    wait_until(gw, indexed, 10)
    again = complete(gw.url, PROMPT)
    assert again.headers["x-replica"] == "backend-1"
    assert tokens(again) == want
    assert metric(second.url, "shoal:kv_peer_fetched_blocks_total") == 18
    assert metric(first.url, "shoal:kv_peer_fetched_blocks_total") == 0
    decisions = httpx.get(gw.url + "/metrics", timeout=5).text
    assert 'shoal:gateway_disagg_decisions_total{decision="peer_fetch"} 1.0' in decisions


def test_a_fetch_from_a_peer_without_the_blocks_computes_the_prompt_and_needs_the_key(fleet):
    _, (first, second) = fleet
    other = "Yet another text, about trains crossing the plains at night. " * 25
    ask = {"kv_transfer_params": {"source": first.url, "prefix": True}}
    keyed = {**auth(KEY), KV_TRANSFER_KEY_HEADER: TRANSFER_KEY}
    fallbacks = metric(second.url, "shoal:kv_transfer_fallbacks_total")
    fetched = tokens(complete(second.url, other, keyed, **ask))  # the first has never seen it
    assert metric(second.url, "shoal:kv_transfer_fallbacks_total") == fallbacks + 1
    assert fetched == tokens(complete(first.url, other))
    refused = complete(second.url, other, auth(KEY), **ask)
    assert refused.status_code == 403
    for r in (first, second):
        r.wait_idle()


def read_stream(gw, path: str, body: dict, move_after: int | None = None) -> dict:
    """Each choice's text (and, for completions, token ids) from a streamed request through the
    gateway; after `move_after` events, its replica's streams are moved (`/fleet/migrate`)."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    events = 0
    with httpx.stream("POST", gw.url + path, json=body, headers=auth(KEY), timeout=120) as r:
        assert r.status_code == 200, r.read()
        replica = r.headers["x-replica"]
        if move_after == 0:  # before its first token: while its prompt is computed
            moved = httpx.post(gw.url + "/fleet/migrate", json={"replica": replica}, headers=auth(KEY))
            assert moved.status_code == 200 and moved.json()["moved"] == 1, moved.text
        for obj in sse_objects(r):
            assert "error" not in obj, obj
            for ch in obj.get("choices") or []:
                piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
                ids.setdefault(ch["index"], []).extend(ch.get("token_ids") or [])
            events += 1
            if events == move_after:
                moved = httpx.post(gw.url + "/fleet/migrate", json={"replica": replica}, headers=auth(KEY))
                assert moved.status_code == 200 and moved.json()["moved"] >= 1, moved.text
    return {"texts": texts, "ids": ids}


SEEDED = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0.8, "seed": 7, "n": 2, "logprobs": 2}
MOVES = {  # name -> (path, body, the event after which the stream moves)
    "during-prefill": (
        "/v1/completions",
        {"prompt": PROMPT * 6, "max_tokens": 16, "temperature": 0.8, "seed": 3, "logprobs": 1},
        0,
    ),
    "seeded-n2-logprobs-early": ("/v1/completions", SEEDED, 1),
    "seeded-n2-logprobs": ("/v1/completions", SEEDED, 12),
    "seeded-n2-logprobs-late": ("/v1/completions", SEEDED, 80),
    "stop-string": (
        "/v1/completions",
        {"prompt": "Count: one, two, three,", "max_tokens": 64, "temperature": 0, "stop": [" twenty"]},
        8,
    ),
    "greedy-chat-grammar": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Describe the sea at night, in JSON."}],
            "max_tokens": 48,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "note",
                    "schema": {
                        "type": "object",
                        "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
                        "required": ["title", "body"],
                    },
                },
            },
        },
        12,
    ),
}


@pytest.mark.parametrize("kind", list(MOVES))
def test_a_stream_moved_mid_generation_streams_exactly_what_it_would_have(fleet, kind):
    gw, reps = fleet
    path, extra, move_after = MOVES[kind]
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "ignore_eos": "stop" not in extra, **extra}
    want = read_stream(gw, path, body)
    outcome = "restarted" if move_after == 0 else "ok"
    moves = metric(gw.url, f'shoal:gateway_migrations_total{{outcome="{outcome}"')
    copies = metric(gw.url, "shoal:gateway_migration_copy_seconds_count")
    fetched = sum(metric(r.url, "shoal:kv_peer_fetched_blocks_total") for r in reps)
    fallbacks = sum(metric(r.url, "shoal:kv_transfer_fallbacks_total") for r in reps)
    got = read_stream(gw, path, body, move_after=move_after)
    assert got["texts"] == want["texts"]
    assert got["ids"] == want["ids"]
    assert metric(gw.url, f'shoal:gateway_migrations_total{{outcome="{outcome}"') == moves + 1
    if move_after:  # (before the first token there is nothing to copy, and no pause)
        assert metric(gw.url, "shoal:gateway_migration_copy_seconds_count") == copies + 1
        # The context went over with the stream: its full blocks were fetched, not computed.
        assert sum(metric(r.url, "shoal:kv_peer_fetched_blocks_total") for r in reps) > fetched
        assert sum(metric(r.url, "shoal:kv_transfer_fallbacks_total") for r in reps) == fallbacks
        assert metric(gw.url, "shoal:gateway_migration_pause_seconds_count") >= 1
    for r in reps:
        r.wait_idle()


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
UNARY = {  # name -> (path, body): non-streamed requests, answered through the gateway as a fold
    "chat-seeded-n2-logprobs-ids": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Name three rivers."}],
            "max_tokens": 24,
            "temperature": 0.9,
            "seed": 11,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "return_token_ids": True,
        },
    ),
    "chat-required-tool-call": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
            "tool_choice": "required",
            "max_tokens": 60,
            "temperature": 0,
        },
    ),
    "completions-two-prompts-n2-logprobs": (
        "/v1/completions",
        {"prompt": ["The sky is", "Rivers flow"], "max_tokens": 12, "temperature": 0.7, "seed": 5}
        | {"n": 2, "logprobs": 3},
    ),
    "completions-echo-logprobs-stop": (
        "/v1/completions",
        {"prompt": "Count: one, two, three,", "max_tokens": 40, "temperature": 0, "echo": True}
        | {"logprobs": 1, "stop": [" ten"], "return_token_ids": True},
    ),
}


def without_ids(answer: dict) -> dict:
    """An answer less what differs between two runs of one request (which of them found the
    prompt cached, too)."""
    out = {k: v for k, v in answer.items() if k not in ("id", "created")}
    out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    for ch in out["choices"]:
        for call in (ch.get("message") or {}).get("tool_calls") or []:
            assert call.pop("id").startswith("call_")
    return out


@pytest.mark.parametrize("kind", list(UNARY))
def test_a_non_streamed_answer_through_the_gateway_is_the_replicas_own(fleet, kind):
    """The gateway relays it as a stream and folds the chunks back: field for field what the
    replica answers to the request itself."""
    gw, (first, _) = fleet
    path, extra = UNARY[kind]
    body = {"model": "SmolLM2-135M-Instruct", **extra}
    direct = httpx.post(first.url + path, json=body, headers=auth(KEY), timeout=120)
    via = httpx.post(gw.url + path, json=body, headers=auth(KEY), timeout=120)
    assert direct.status_code == via.status_code == 200, (direct.text, via.text)
    assert without_ids(via.json()) == without_ids(direct.json())
    if "tools" in body:
        assert via.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert via.json()["id"] and via.headers["x-replica"] in ("backend-0", "backend-1")


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_non_streamed_request_moved_mid_generation_answers_as_if_unmoved(fleet, kind):
    """Moved off its replica while it decodes, with seeded sampling, n=2 and logprobs: its one
    answer is the one it gives unmoved, and the move is a migration, not a rerun."""
    gw, reps = fleet
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    body = {"model": "SmolLM2-135M-Instruct", **SEEDED, "max_tokens": 96, "ignore_eos": True}
    if kind == "chat":
        del body["prompt"], body["logprobs"]
        body |= {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": 2}
    want = httpx.post(gw.url + path, json=body, headers=auth(KEY), timeout=120)
    assert want.status_code == 200, want.text
    moves = metric(gw.url, 'shoal:gateway_migrations_total{outcome="ok"')
    failovers = metric(gw.url, "shoal:gateway_failovers_total")
    made = {r.url: metric(r.url, "shoal:generation_tokens_total") for r in reps}
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, gw.url + path, json=body, headers=auth(KEY), timeout=120)

        def decoding() -> str | None:  # the replica it runs on, once it has made a few tokens
            return next(
                (r for r in reps if metric(r.url, "shoal:generation_tokens_total") >= made[r.url] + 16), None
            )

        source = wait_until(gw, decoding, 60)
        name = "backend-0" if source is reps[0] else "backend-1"
        moved = httpx.post(gw.url + "/fleet/migrate", json={"replica": name}, headers=auth(KEY))
        assert moved.status_code == 200 and moved.json()["moved"] == 1, moved.text
        got = sent.result()
    assert got.status_code == 200, got.text
    assert without_ids(got.json()) == without_ids(want.json())
    assert metric(gw.url, 'shoal:gateway_migrations_total{outcome="ok"') == moves + 1
    assert metric(gw.url, "shoal:gateway_failovers_total") == failovers
    for r in reps:
        r.wait_idle()
