"""A real `shoal serve` on 127.0.0.1, driven with the official openai SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import openai
import pytest

from tests.conftest import REF_TOKENS
from tests.helpers import PROMPTS
from tests.server_helpers import raw_post, start_server

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server():
    s = start_server("--kv-cache-memory", "512MiB", "--max-num-seqs", "48", "--quantization", "none")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def sse_events(server, path, body) -> list:
    """The raw SSE data lines of one streamed request, [DONE] included."""
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_probes_models_and_request_id(server, model):
    assert server.get("/health").json()["status"] == "ok"
    assert server.get("/ready").status_code == 200
    models = server.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == model == "SmolLM2-135M-Instruct"
    r = server.post(
        "/v1/completions",
        json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2},
        headers={"x-request-id": "trace-42"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    load = server.get("/load").json()
    assert {"running", "waiting", "kv_usage", "free_blocks", "num_blocks"} <= load.keys()


def test_batch_of_token_prompts_matches_hf(client, model, bundled, reference):
    prompts = [reference[p][0] for p in PROMPTS]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=REF_TOKENS, **GREEDY)
    assert len(out.choices) == len(PROMPTS)
    for choice, p in zip(sorted(out.choices, key=lambda c: c.index), PROMPTS):
        assert choice.text == bundled.tokenizer.decode(reference[p][1]), p
        assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert out.usage.completion_tokens == REF_TOKENS * len(PROMPTS)


def test_streaming_equals_non_streaming(client, model, server):
    for n in (1, 2):
        body = {"model": model, "prompt": "The three primary colours are", "max_tokens": 20, "n": n}
        full = client.completions.create(**body, **GREEDY)
        events = sse_events(
            server,
            "/v1/completions",
            {
                **body,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        texts, finishes = [""] * n, [[] for _ in range(n)]
        for c in chunks[:-1]:
            (choice,) = c["choices"]
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]].append(choice["finish_reason"])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full.usage.model_dump(exclude_none=True)
        for ch in full.choices:
            assert texts[ch.index] == ch.text
            assert finishes[ch.index] == [ch.finish_reason]  # exactly one finish_reason per choice


def test_chat_stream_and_usage_match_the_tokenizer(client, model, bundled):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    full = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12, **GREEDY)
    assert full.usage.prompt_tokens == len(bundled.tokenizer.encode_chat(messages))
    assert full.usage.completion_tokens == 12
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    text, finishes, usage = "", [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert text == full.choices[0].message.content
    assert finishes == ["length"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 12)
    # The second asking found the first one's full prompt blocks in the prefix cache.
    assert full.choices[0].message.refusal is None
    block = 16
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // block * block


def test_n3_sampled_choices_and_usage(client, model):
    out = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=10, n=3, temperature=1.0, seed=7, logprobs=0
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    assert len({c.text for c in out.choices}) > 1  # children draw their own samples
    again = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=10, n=3, temperature=1.0, seed=7, logprobs=0
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.bytes == list(t.token.encode())


def test_echo_with_logprobs_includes_the_prompt(client, model, bundled):
    prompt = "The capital of France is"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=4, echo=True, logprobs=2, **GREEDY)
    ch = out.choices[0]
    n_prompt = len(bundled.tokenizer.encode(prompt))
    assert ch.text.startswith(prompt)
    lp = ch.logprobs
    assert len(lp.tokens) == n_prompt + 4 and "".join(lp.tokens) == ch.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]


BAD_REQUESTS = [
    ("completions", {"prompt": "x", "max_tokens": -1}, openai.BadRequestError, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 10**7}, openai.BadRequestError, "context_length_exceeded"),
    ("completions", {"prompt": "x", "logprobs": 50}, openai.BadRequestError, "logprobs"),
    ("completions", {"prompt": "x", "temperature": "hot"}, openai.BadRequestError, "temperature"),
    ("completions", {"prompt": [10**9]}, openai.BadRequestError, "vocabulary"),
    ("completions", {"prompt": "x", "n": 0}, openai.BadRequestError, "n"),
    ("completions", {"prompt": "x", "model": "nope"}, openai.NotFoundError, "nope"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30, "logprobs": True},
        openai.BadRequestError,
        "top_logprobs",
    ),
    ("chat", {"messages": [], "max_tokens": 3}, openai.BadRequestError, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, openai.BadRequestError, "role"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "x " * 9000}]},
        openai.BadRequestError,
        "context_length_exceeded",
    ),
]


@pytest.mark.parametrize(("route", "body", "error", "mentions"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    client, model, server, route, body, error, mentions
):
    body = {"model": model, **body}
    if route == "completions":
        create, key = client.completions.create, "prompt"
    else:
        create, key = client.chat.completions.create, "messages"
    required = {"model": body.pop("model"), key: body.pop(key)}
    with pytest.raises(error) as info:
        create(**required, extra_body=body)  # extra_body: send values the SDK's types would refuse
    err = info.value.body
    assert set(err) >= {"message", "type", "param", "code"}
    assert mentions in json.dumps(err)
    ok = client.completions.create(model=model, prompt="Hello", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
    server.wait_idle()


def test_malformed_bodies_never_leak_fastapi_shapes(server):
    for path, kwargs in [
        ("/v1/completions", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
        ("/v1/completions", {"json": {}}),
        ("/v1/chat/completions", {"json": {"messages": "hello"}}),
        ("/v1/chat/completions", {"json": [1, 2]}),
    ]:
        r = server.post(path, **kwargs)
        assert r.status_code == 400, r.text
        assert set(r.json()) == {"error"} and r.json()["error"]["type"] == "invalid_request_error"
    r = server.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_async_clients_stream_concurrently(server, model, client):
    prompts = [f"Fact number {i}:" for i in range(6)]
    expected = [
        client.completions.create(model=model, prompt=p, max_tokens=16, **GREEDY).choices[0].text
        for p in prompts
    ]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(p):
            text = ""
            async for chunk in await aclient.completions.create(
                model=model, prompt=p, max_tokens=16, stream=True, **GREEDY
            ):
                text += chunk.choices[0].text if chunk.choices else ""
            return text

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(run()) == expected
    server.wait_idle()


def test_a_dropped_connection_aborts_within_a_step_and_frees_blocks(server, model):
    body = {
        "model": model,
        "prompt": "Tell me a very long story.",
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert server.get("/load").json()["running"] == 1
    # The connection is closed here, mid-stream.
    steps_at_close = server.get("/load").json()["num_steps"]
    load = server.wait_idle(timeout=10)
    assert load["num_steps"] - steps_at_close <= 2


def test_health_answers_fast_while_the_engine_is_saturated(server, model):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            body = {
                "model": model,
                "prompt": "Write an essay about rivers.",
                "max_tokens": 48,
                "ignore_eos": True,
            }
            work = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(32)]
            while server.get("/load").json()["running"] < 16:
                await asyncio.sleep(0.05)
            latencies = []
            for _ in range(15):
                t0 = time.perf_counter()
                r = await c.get("/health")
                latencies.append(time.perf_counter() - t0)
                assert r.status_code == 200
                await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            steps0 = server.get("/load").json()["num_steps"]
            results = await asyncio.gather(*work)
            step_s = (time.perf_counter() - t0) / max(1, server.get("/load").json()["num_steps"] - steps0)
            return latencies, results, step_s

    latencies, results, step_s = asyncio.run(run())
    assert all(r.status_code == 200 for r in results)
    # Measured against the engine's own step time, so a loaded machine slows both alike: a probe
    # that waited for steps would take about half a step at the median.
    assert statistics.median(latencies) < 0.25 * step_s, (latencies, step_s)
    server.wait_idle()


def test_metrics_count_what_was_served(server, model):
    def scrape() -> dict[str, float]:
        values = {}
        for line in server.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    label = f'{{model_name="{model}"}}'
    before = scrape()
    server.post(
        "/v1/completions",
        json={"model": model, "prompt": [5000, 6000, 7000], "max_tokens": 7, "ignore_eos": True},
    )
    after = scrape()

    def delta(name):
        return after.get(name + label, 0) - before.get(name + label, 0)

    assert delta("shoal:prompt_tokens_total") == 3
    assert delta("shoal:generation_tokens_total") == 7
    assert delta("shoal:time_to_first_token_seconds_count") == 1
    assert delta("shoal:inter_token_latency_seconds_count") == 6
    assert delta("shoal:e2e_request_latency_seconds_count") == 1
    assert delta("shoal:request_queue_time_seconds_count") == 1
    assert delta("shoal:prefix_cache_queries_total") == 3
    for gauge in ("shoal:num_requests_running", "shoal:num_requests_waiting", "shoal:kv_cache_usage_perc"):
        assert gauge + label in after
    assert "shoal:num_preemptions_total" + label in after


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "A long tale:"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A long tale, please."}]}),
    ],
    ids=["completions", "chat"],
)
def test_a_non_streamed_request_stops_at_once_when_its_client_leaves(server, model, path, body):
    body = {"model": model, **body, "max_tokens": 2000, "ignore_eos": True}
    with raw_post(server.url, path, body):
        deadline = time.monotonic() + 30
        while server.get("/load").json()["running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    steps_at_close = server.get("/load").json()["num_steps"]
    load = server.wait_idle(timeout=10)
    # The step under way, and the one the engine may have begun before the abort reached it.
    assert load["num_steps"] - steps_at_close <= 2


def test_tokenize_and_detokenize(server, model, bundled):
    text = "Hello, tokenizer!"
    r = server.post("/tokenize", json={"model": model, "prompt": text}).json()
    assert r["tokens"] == bundled.tokenizer.encode(text) and r["count"] == len(r["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    r2 = server.post("/tokenize", json={"messages": messages}).json()
    assert r2["tokens"] == bundled.tokenizer.encode_chat(messages)
    assert server.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == text
    bad = server.post("/detokenize", json={"tokens": [10**8]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_bench_serve_against_the_server(server, model, tmp_path, bundled):
    import random

    from shoal.bench.arrivals import Burst, arrival_times
    from shoal.bench.serve import ServeBenchConfig, run_serve_bench
    from shoal.bench.workload import exact_length_text

    rng = random.Random(3)
    for n in (1, 7, 32, 100):
        assert len(bundled.tokenizer.encode(exact_length_text(bundled.tokenizer, n, rng))) == n
    s = run_serve_bench(
        ServeBenchConfig(
            base_url=server.url,
            num_requests=6,
            max_concurrency=3,
            input_len=24,
            output_len=8,
            json_path=str(tmp_path / "r.json"),
        )
    )
    assert s["completed"] == 6 and s["total_output_tokens"] == 48 and s["total_input_tokens"] == 6 * 24
    assert 0 < s["ttft_s"]["p50"] <= s["e2e_s"]["p50"]
    # The client's own CPU while it sent and read: some, and (one thread of asyncio) at most the run.
    assert 0 < s["client_cpu_s"] <= s["duration_s"] * 1.1
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text(
        "\n".join(
            json.dumps(
                {
                    "conversations": [
                        {"from": "human", "value": f"Question {i}?"},
                        {"from": "gpt", "value": "A"},
                    ]
                }
            )
            for i in range(4)
        )
    )
    s = run_serve_bench(
        ServeBenchConfig(
            base_url=server.url,
            endpoint="chat",
            dataset=str(dataset),
            num_requests=4,
            output_len=5,
            request_rate=50.0,
            slo_ttft_ms=60_000,
            slo_tpot_ms=60_000,
        )
    )
    assert s["completed"] == 4 and s["total_output_tokens"] == 20 and s["goodput"] > 0
    assert (tmp_path / "r.json").exists()
    # With bursts, requests go out on the schedule the simulator draws for the same load.
    bursts = (Burst(1.0, 1.0, 8.0),)
    cfg = ServeBenchConfig(
        base_url=server.url,
        num_requests=16,
        input_len=8,
        output_len=2,
        request_rate=3.0,
        bursts=bursts,
        seed=5,
        json_path=str(tmp_path / "burst.json"),
    )
    assert run_serve_bench(cfg)["completed"] == 16
    sent = [r["start"] for r in json.loads((tmp_path / "burst.json").read_text())["records"]]
    schedule = arrival_times(16, 3.0, bursts, random.Random(5))
    assert sum(1.0 <= t < 2.0 for t in schedule) >= 8  # the burst: 24 a second for a second
    assert all(abs(a - b) < 0.1 for a, b in zip(sent, schedule, strict=True)), (sent, schedule)


def test_bench_serve_draws_lengths_from_ranges(server, bundled, tmp_path):
    """Each request's prompt and output tokens drawn from their ranges, the same draws that
    request_lengths gives a simulator of the run; the server streams each its own length."""
    from shoal.bench.serve import ServeBenchConfig, run_serve_bench
    from shoal.bench.workload import request_lengths, synthetic

    cfg = ServeBenchConfig(
        base_url=server.url,
        num_requests=8,
        max_concurrency=4,
        input_len_range=(4, 40),
        output_len_range=(1, 9),
        seed=11,
        json_path=str(tmp_path / "ranges.json"),
    )
    assert run_serve_bench(cfg)["completed"] == 8
    drawn = request_lengths(8, cfg.input_len, cfg.output_len, 11, (4, 40), (1, 9))
    assert len({n for n, _ in drawn}) > 1 and len({m for _, m in drawn}) > 1
    records = json.loads((tmp_path / "ranges.json").read_text())["records"]
    assert [r["output_tokens"] for r in records] == [m for _, m in drawn]
    prompts = synthetic(bundled.tokenizer, 8, cfg.input_len, cfg.output_len, 11, False, (4, 40), (1, 9))
    assert [len(bundled.tokenizer.encode(p.prompt)) for p in prompts] == [n for n, _ in drawn]
    for bad in ((5, 2), (0, 3)):
        with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
            ServeBenchConfig(output_len_range=bad)


def test_kv_events_feed_for_routers(server, model, bundled):
    from shoal.protocol.block_hash import hash_blocks

    start = server.get("/kv_events").json()
    ids = list(range(2000, 2040))  # 40 tokens: two full blocks of 16
    server.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1})
    feed = server.get("/kv_events", params={"after": start["next"]}).json()
    assert feed["instance"] == start["instance"] and feed["block_size"] == 16
    stored = [e["block_hash"] for e in feed["events"] if e["kind"] == "stored"]
    assert hash_blocks(ids, 16)[:2] == stored[:2]  # the router's hashes are the engine's
    assert feed["events"][1]["parent_hash"] == stored[0]
    assert server.get("/kv_events", params={"after": feed["next"]}).json()["events"] == []
    assert server.get("/kv_events", params={"after": 10**22}).status_code == 400
