"""A replica attacked as a hostile or careless client would: poison values, hostile bodies, auth on
every route, failing steps, a dying engine, a dying supervisor. After each, the server is healthy
and its KV pool is back to idle (or, where the engine died, the process is gone)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_helpers import start_server

MODEL = "SmolLM2-135M-Instruct"
KEY = "adversarial-key"
STEP_ERROR = "POISON-STEP-MARKER"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    os.environ["SHOAL_FAULT_STEP_ERROR_ON"] = STEP_ERROR
    try:
        s = start_server("--api-key", KEY, "--max-model-len", "256", "--kv-cache-memory", "256MiB")
    finally:
        del os.environ["SHOAL_FAULT_STEP_ERROR_ON"]
    yield s
    s.stop()


def post(server, path: str, body, **kw) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(server.url + path, content=data, headers=headers, timeout=120, **kw)


def assert_openai_error(r: httpx.Response, status: int, code_or_param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= err.keys()
    if code_or_param is not None:
        assert code_or_param in (err["code"], err["param"]) or code_or_param in err["message"], err


def assert_unharmed(server) -> None:
    assert server.get("/health").status_code == 200
    server.wait_idle()


def completion(prompt="The sea is", **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields}


def chat(content="Hi", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def fn(name: str, parameters: dict | None = None) -> dict:
    return {
        "type": "function",
        "function": {"name": name, **({"parameters": parameters} if parameters else {})},
    }


def call(name: str, arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


POISON = [
    # (body, expected status, code or param the error names)
    (completion(seed=2**64), 400, "seed"),
    (completion(seed=-(2**63) - 1), 400, "seed"),
    (completion(seed=2**63 - 1, n=2, temperature=1.0), 200, None),
    (completion(seed=-(2**63), n=3, temperature=1.0), 200, None),
    (completion(top_k=10**20, temperature=1.0), 200, None),
    (completion(top_k=2**63, temperature=1.0, seed=1), 200, None),
    (completion(priority=2**70), 400, "priority"),
    (completion(stop_token_ids=list(range(5000))), 400, "stop_token_ids"),
    (completion(stop_token_ids=[2**40]), 400, "stop_token_ids"),
    (completion(logit_bias={"99999999": 1}), 400, "logit_bias"),
    (completion(logit_bias={"abc": 1}), 400, "logit_bias"),
    (completion(logit_bias={"1": 1000}), 400, "logit_bias"),
    (completion(stop=["x"] * 17), 400, "stop"),
    (completion(max_tokens=2**63), 400, "context_length_exceeded"),
    (completion(min_tokens=10**9, max_tokens=None), 400, "min_tokens"),
    (completion(n=10**6), 400, "n"),
    (completion(prompt=[[1]] * 1000), 400, "prompt"),
    (completion(prompt=[2**31 + 5]), 400, "prompt"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), 200, None),
    (chat(tool_choice="required"), 400, "tool_choice"),
    (chat(tools=[fn("f")], tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    (chat(tools=[fn("f"), fn("f")]), 400, "tools"),
    (chat(tools=[fn("f", {"type": "nope"})], tool_choice="required"), 400, "tools"),
    (chat(tools=[fn("f", {"type": "nope"})]), 400, "tools"),
    (chat(tools=[fn('no spaces; or quotes"')]), 400, "tools"),
    (chat(tools=[fn("f")] * 129), 400, "tools"),
    (chat(tools=[{"type": "retrieval"}]), 400, "tools"),
    (chat(tools=[fn("f")], tool_choice="sometimes"), 400, "tool_choice"),
    (
        chat(tools=[fn("f")], tool_choice="required", response_format={"type": "json_object"}),
        400,
        "tool_choice",
    ),
    (chat(tools=[fn("f")], tool_choice="required", max_tokens=8, parallel_tool_calls=False), 200, None),
    (chat(functions=[{"name": "f"}]), 400, "functions"),
    (completion(tools=[fn("f")]), 400, "tools"),
    (
        {
            **chat(),
            "messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
        },
        400,
        "messages",
    ),
    (
        {**chat(), "messages": [{"role": "user", "tool_calls": [call("f", "{}")], "content": "x"}]},
        400,
        "messages",
    ),
    (
        {
            **chat(),
            "messages": [
                {"role": "assistant", "tool_calls": [call("f", "not json")]},
                {"role": "user", "content": "x"},
            ],
        },
        200,
        None,
    ),
    (chat(response_format={"type": "json_object"}), 200, None),
    (
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
        400,
        "response_format",
    ),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format"),
    (chat(response_format={"type": "xml"}), 400, "response_format"),
    (completion(guided_regex="(unclosed"), 400, "guided_regex"),
    (completion(guided_choice=[]), 400, "guided_choice"),
    (completion(guided_grammar="start: ("), 400, "guided_grammar"),
    (completion(guided_regex="a", guided_choice=["b"]), 400, None),
    (chat(modalities=["audio"]), 400, "modalities"),
    (chat([{"type": "image_url", "image_url": {"url": "data:,"}}]), 400, "messages"),
    (chat([{"type": "text", "text": "hi"}], stream=None, n=None, logprobs=None, top_p=None), 200, None),
    (chat(response_format={"type": "text"}, tool_choice="none"), 200, None),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    (chat(resume={"prompt_token_ids": [1, 2], "output_token_ids": [3]}, n=2), 400, "n"),
]


@pytest.mark.parametrize("body, status, named", POISON)
def test_poison_values_fail_alone(server, body, status, named):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(server, path, body)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert_openai_error(r, status, named)
    assert_unharmed(server)


HOSTILE_BODIES = [
    (b'{"model": "' + MODEL.encode() + b'", "prompt": "a", "temperature": NaN}', "NaN"),
    (b'{"model": "' + MODEL.encode() + b'", "prompt": "a", "temperature": 1e999}', "temperature"),
    (b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800 lone"}', "surrogate"),
    (b'{"model": "' + MODEL.encode() + b'", "prompt": "\\udfff", "stop": ["\\ud83d"]}', "surrogate"),
    (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests"),
    (b'{"model": "x", "prompt": "a"' + b"}" * 3, "JSON"),
    (b"\xff\xfe\x00garbage", "JSON"),
    (b"[1, 2, 3]", "object"),
    (b"", "JSON"),
]


@pytest.mark.parametrize("raw, named", HOSTILE_BODIES)
def test_hostile_bodies_get_a_400(server, raw, named):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = post(server, path, raw)
        assert_openai_error(r, 400)
        assert named.lower() in r.text.lower(), r.text
    assert_unharmed(server)


def test_sampling_extremes_mean_what_they_say(server):
    greedy = post(server, "/v1/completions", completion(max_tokens=12, temperature=0)).json()
    text = greedy["choices"][0]["text"]
    for fields in ({"temperature": 1e-300}, {"top_p": 1e-300}, {"top_p": 0}, {"top_k": 1, "temperature": 2}):
        r = post(server, "/v1/completions", completion(max_tokens=12, seed=3, **fields))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, fields
    # logit_bias moves the output as asked: a +100 bias on one token makes it the whole answer.
    tok = post(server, "/tokenize", {"model": MODEL, "prompt": " banana"}).json()["tokens"][-1]
    biased = post(
        server, "/v1/completions", completion(max_tokens=3, temperature=0, logit_bias={str(tok): 100})
    )
    assert biased.json()["choices"][0]["text"] == " banana" * 3
    assert_unharmed(server)


FIELD_VALUES = {
    "seed": st.sampled_from([0, -1, 2**63 - 1, -(2**63), 2**64, 2**100, -(2**100)]),
    "n": st.sampled_from([0, 1, 2, 16, 17, 2**31, -1]),
    "temperature": st.sampled_from([0, 1e-300, 1e-5, 0.5, 2, 2.0000001, -1e-300, 1e300]),
    "top_p": st.sampled_from([0, 1e-300, 0.5, 1, 1.0000001, -0.0]),
    "top_k": st.sampled_from([-2, -1, 0, 1, 10**20, 2**63]),
    "min_p": st.sampled_from([0, 1e-300, 1, 1.5]),
    "repetition_penalty": st.sampled_from([1e-300, 1, 1e300, 0, -1]),
    "presence_penalty": st.sampled_from([-2, 2, 2.5, 1e-300]),
    "frequency_penalty": st.sampled_from([-2, 2, -2.5]),
    "max_tokens": st.sampled_from([0, 1, 3, -1, 10**9, 2**63]),
    "min_tokens": st.sampled_from([0, 2, 10**9, -1]),
    "logprobs": st.sampled_from([0, 5, 20, 21, -1, 2**63]),
    "priority": st.sampled_from([-(2**40), -5, 0, 5, 2**31, 2**63]),
    "stop_token_ids": st.sampled_from([[], [0], [2**31], [-1], list(range(1025))]),
    "logit_bias": st.sampled_from([{}, {"0": -100}, {"5": 100.0}, {"-1": 1}, {"0": 101}]),
    "stop": st.sampled_from([None, "", [""], ["a" * 2048], ["a" * 2049], "\n"]),
}


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    fields=st.fixed_dictionaries({}, optional=FIELD_VALUES),
    route=st.sampled_from(["completions", "chat"]),
)
def test_numeric_extremes_never_break_the_server(server, fields, route):
    if route == "chat":
        fields = {**fields, "logprobs": fields.get("logprobs") is not None}
        body, path = chat(**fields), "/v1/chat/completions"
    else:
        body, path = completion(**fields), "/v1/completions"
    body.setdefault("max_tokens", 3)
    r = post(server, path, body)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert_openai_error(r, 400)
    else:
        assert r.json()["choices"]
    assert server.get("/health").status_code == 200


def test_bodies_past_the_limit_get_413_and_huge_prompts_a_fast_400(server):
    proc = psutil.Process(server.proc.pid)
    rss_before = proc.memory_info().rss

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            too_big = c.post("/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
            huge = json.dumps(completion(prompt="word " * 600_000)).encode()  # 3 MB: under the limit
            big = [asyncio.create_task(c.post("/v1/completions", content=huge)) for _ in range(4)]
            chat_huge = json.dumps(chat(content="word " * 600_000)).encode()
            big.append(asyncio.create_task(c.post("/v1/chat/completions", content=chat_huge)))
            health = []
            while not all(t.done() for t in big):
                t0 = time.perf_counter()
                health.append(((await c.get("/health")).status_code, time.perf_counter() - t0))
                await asyncio.sleep(0.02)
            return await too_big, [t.result() for t in big], health

    too_big, answers, health = asyncio.run(run())
    assert_openai_error(too_big, 413, "body_too_large")
    for r in answers:
        assert_openai_error(r, 400, "context_length_exceeded")
    assert all(code == 200 for code, _ in health)
    # The tokenizer never saw the 3 MB prompts: nothing large was allocated, so nothing stays.
    assert proc.memory_info().rss - rss_before < 150 << 20
    assert_unharmed(server)


def test_every_route_but_the_probes_needs_the_key(server):
    schema = server.get("/openapi.json").json()
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]
    assert ("GET", "/load") in routes and ("GET", "/kv_events") in routes
    open_routes = {"/health", "/ready", "/metrics", "/docs", "/openapi.json"}
    for method, path in routes:
        bare = httpx.request(method, server.url + path, timeout=30, json={})
        if path in open_routes:
            assert bare.status_code != 401, path
        else:
            assert_openai_error(bare, 401, "invalid_api_key")
            keyed = httpx.request(method, server.url + path, timeout=30, json={}, headers=AUTH)
            assert keyed.status_code != 401, path
    # The probes say nothing about prompts: no text, ids or hashes.
    assert "block_hash" not in httpx.get(server.url + "/metrics", timeout=30).text


def test_a_failing_step_fails_only_its_request(server):
    prompts = [f"Tell me a fact about the number {i}." for i in range(4)]
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}

    async def run(poison: bool):
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            good = [c.post("/v1/completions", json=completion(p, **body)) for p in prompts]
            bad = []
            if poison:
                bad = [
                    c.post("/v1/completions", json=completion(f"{STEP_ERROR} hello", **body)),
                    c.post("/v1/chat/completions", json=chat(f"{STEP_ERROR} hi", n=2, **body)),
                    c.post("/v1/completions", json=completion(f"{STEP_ERROR} x", stream=True, **body)),
                ]
            return await asyncio.gather(*good, *bad)

    clean = [r.json()["choices"][0]["text"] for r in asyncio.run(run(poison=False))]
    *good, bad, bad_chat, bad_stream = asyncio.run(run(poison=True))
    assert [r.json()["choices"][0]["text"] for r in good] == clean
    assert_openai_error(bad, 500, "internal_error")
    assert_openai_error(bad_chat, 500, "internal_error")
    events = [line[6:] for line in bad_stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert_unharmed(server)


def test_long_stop_strings_do_not_hold_back_the_stream(server):
    body = completion("Count: 1, 2, 3,", max_tokens=40, temperature=0, ignore_eos=True, stream=True)
    body["stop"] = ["z" * 2048, "q" * 1000 + "!"]
    r = post(server, "/v1/completions", body)
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in r.text.splitlines() if e.startswith("data: {")]
    assert sum(1 for t in texts if t) > 20  # streamed as it came, not in one piece at the end
    assert_unharmed(server)


def test_a_stop_string_split_across_tokens_is_still_held_back(server):
    full = post(server, "/v1/completions", completion("Count: 1, 2, 3,", max_tokens=30, temperature=0)).json()
    text = full["choices"][0]["text"]
    stop = text[8:14]
    r = post(
        server,
        "/v1/completions",
        completion("Count: 1, 2, 3,", max_tokens=30, temperature=0, stop=[stop], stream=True),
    )
    streamed = "".join(
        json.loads(e[6:])["choices"][0]["text"] for e in r.text.splitlines() if e.startswith("data: {")
    )
    assert streamed == text[: text.index(stop)]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_resume_continues_token_for_token(server, route):
    """What the gateway sends when a replica dies mid-stream: prompt ids and streamed ids."""
    for fields in ({"temperature": 0}, {"temperature": 0.9, "seed": 11, "frequency_penalty": 0.5}):
        base = {"max_tokens": 30, "ignore_eos": True, "return_token_ids": True, "logprobs": 2, **fields}
        if route == "chat":
            base["logprobs"], base["top_logprobs"] = True, 2
            body, path = chat("Write about the moon.", **base), "/v1/chat/completions"
        else:
            body, path = completion("The moon is", **base), "/v1/completions"
        full = post(server, path, body).json()["choices"][0]
        ids, prompt_ids = full["token_ids"], full["prompt_token_ids"]
        resume = {"prompt_token_ids": prompt_ids, "output_token_ids": ids[:12]}
        rest = post(server, path, {**body, "resume": resume}).json()
        choice = rest["choices"][0]
        assert choice["token_ids"] == ids[12:], fields
        assert rest["usage"]["completion_tokens"] == 30
        # The resumed replica computes the streamed tokens as a prefill, not step by step: the
        # same numbers up to float rounding.
        if route == "chat":
            got = [e["logprob"] for e in choice["logprobs"]["content"]]
            want = [e["logprob"] for e in full["logprobs"]["content"][12:]]
            assert [e["token"] for e in choice["logprobs"]["content"]] == [
                e["token"] for e in full["logprobs"]["content"][12:]
            ]
        else:
            got, want = choice["logprobs"]["token_logprobs"], full["logprobs"]["token_logprobs"][12:]
        assert got == pytest.approx(want, abs=1e-3)
    assert_unharmed(server)


def test_resume_of_choice_one_draws_as_choice_one(server):
    body = completion("Once upon a time", max_tokens=20, n=2, temperature=1.0, seed=5, ignore_eos=True)
    body["return_token_ids"] = True
    full = post(server, "/v1/completions", body).json()
    second = next(c for c in full["choices"] if c["index"] == 1)
    resume = {
        "prompt_token_ids": second["prompt_token_ids"],
        "output_token_ids": second["token_ids"][:7],
        "index": 1,
    }
    rest = post(server, "/v1/completions", {**body, "n": 1, "resume": resume}).json()["choices"][0]
    assert rest["index"] == 1 and rest["token_ids"] == second["token_ids"][7:]


def test_max_tokens_zero_scores_the_prompt(server):
    r = post(
        server,
        "/v1/completions",
        completion("The capital of France is Paris", max_tokens=0, echo=True, logprobs=1),
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == "The capital of France is Paris"
    lps = choice["logprobs"]["token_logprobs"]
    assert lps[0] is None and all(isinstance(v, float) and v <= 0 for v in lps[1:])
    assert r.json()["usage"]["completion_tokens"] == 0
    assert_unharmed(server)


def test_a_client_can_only_lower_its_own_priority():
    s = start_server("--max-num-seqs", "1", "--max-model-len", "256", "--kv-cache-memory", "128MiB")
    try:

        async def run():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                done: list[str] = []

                async def go(name, priority, tokens):
                    body = completion(name, max_tokens=tokens, ignore_eos=True, priority=priority)
                    await c.post("/v1/completions", json=body)
                    done.append(name)

                first = asyncio.create_task(go("first", 0, 40))
                while s.get("/load").json()["running"] == 0:
                    await asyncio.sleep(0.01)
                polite = asyncio.create_task(go("polite", 0, 4))
                await asyncio.sleep(0.3)
                pushy = asyncio.create_task(go("pushy", -1000, 4))  # would jump the queue if trusted
                await asyncio.gather(first, polite, pushy)
                return done

        assert asyncio.run(run()) == ["first", "polite", "pushy"]
    finally:
        s.stop()


def test_cancelled_streams_are_counted(server):
    def aborted() -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in server.get("/metrics").text.splitlines()
            if line.startswith("shoal:request_success_total") and 'finished_reason="abort"' in line
        )

    before = aborted()
    body = completion("Tell me a long story.", max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 30
    while aborted() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1
    assert_unharmed(server)


def test_a_dead_engine_loop_exits_the_process():
    os.environ["SHOAL_FAULT_CRASH_ON"] = "KILL-THE-ENGINE"
    try:
        s = start_server("--max-model-len", "128", "--kv-cache-memory", "64MiB")
    finally:
        del os.environ["SHOAL_FAULT_CRASH_ON"]
    try:
        ok = httpx.post(s.url + "/v1/completions", json=completion(), timeout=60)
        assert ok.status_code == 200
        try:
            r = httpx.post(s.url + "/v1/completions", json=completion("KILL-THE-ENGINE now"), timeout=60)
            assert r.status_code >= 500
        except httpx.HTTPError:
            pass  # the process went down under the request: also an answer
        assert s.proc.wait(60) == 3  # EXIT_ENGINE_DEAD: its supervisor restarts it
    finally:
        s.stop()


def test_a_replica_dies_with_its_supervisor(tmp_path):
    """The parent-pid watch of `shoal serve` (the fleet's fallback where no death signal exists)."""
    log = tmp_path / "serve.log"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "env = {**os.environ, 'SHOAL_PARENT_PID': str(os.getpid())}\n"
            f"p = subprocess.Popen([sys.executable, '-m', 'shoal.cli', 'serve', '--port', '0'],"
            f" env=env, stdout=open({str(log)!r}, 'w'), stderr=subprocess.STDOUT, start_new_session=True)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = psutil.Process(int(parent.stdout.readline()))
    time.sleep(1.5)
    assert child.is_running()
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    child.wait(30)  # raises TimeoutExpired if it outlives its supervisor
