"""A real gateway over two stand-in replicas (real HTTP servers on 127.0.0.1 that stream as shoal's
replicas do, and break their streams on cue): however a relayed stream ends, every replica it held
is given back, and the client reads an answer or an error, never a cut connection.

A stand-in streams three tokens and then breaks the way its prompt names; a continuation (a body
with `resume`) is answered by the other stand-in, at once or after a long pause."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tests.fleet_helpers import auth, replicas, start_gateway
from tests.server_helpers import StandIn, stand_in_app

KEY = "sk-relay-test"
PROMPT_IDS = [100, 101, 102]
BREAKS = {
    # how the original stream breaks after its three tokens, and how long a continuation waits
    "error": ({"error": {"message": "boom", "type": "server_error", "code": "oops"}}, 60.0),
    "malformed-choice": ({"id": "x", "choices": [1]}, 0.0),
    "malformed-ids": ({"id": "x", "choices": [{"index": 0, "text": "d", "token_ids": "4"}]}, 0.0),
    "malformed-usage": ({"id": "x", "choices": [], "usage": 7}, 0.0),
}


def chunk(text: str, ids: list[int], finish: str | None = None, prompt: bool = False) -> dict:
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    if prompt:
        choice["prompt_token_ids"] = PROMPT_IDS
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}


def stand_in(seen: list) -> FastAPI:
    app = stand_in_app()

    @app.post("/v1/completions")
    async def completions(raw: Request):
        body = await raw.json()
        seen.append(body)
        breaking, pause = BREAKS[body["prompt"]]
        if "resume" in body:
            await asyncio.sleep(pause)  # before its headers: the gateway waits in its open

            async def rest():
                yield f"data: {json.dumps(chunk(' rest', [9], 'length'))}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(rest(), media_type="text/event-stream")

        async def broken():
            for i, text in enumerate("abc"):
                yield f"data: {json.dumps(chunk(text, [i + 1], prompt=i == 0))}\n\n"
                await asyncio.sleep(0.05)
            yield f"data: {json.dumps(breaking)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(broken(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stand_ins():
    """(their URLs, the bodies they were sent)."""
    seen: list = []
    with StandIn(stand_in(seen)) as one, StandIn(stand_in(seen)) as other:
        yield [one.url, other.url], seen


@pytest.fixture
def relay(stand_ins):
    """A gateway of the test's own (a replica that broke streams in one test is not ejected in
    the next), and the bodies the stand-ins are sent."""
    urls, seen = stand_ins
    seen.clear()
    gw = start_gateway(urls, "--policy", "round_robin", api_key=KEY)
    yield gw, seen
    gw.stop()


def held(gw) -> dict[str, int]:
    return {name: r["inflight"] for name, r in replicas(gw, KEY).items()}


def wait_all_given_back(gw, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(held(gw).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(held(gw).values()), held(gw)


def body(prompt: str) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 8, "stream": True, "return_token_ids": True}


def test_a_client_leaving_while_its_stream_fails_over_frees_both_replicas(relay):
    gw, seen = relay

    async def leave_during_the_failover():
        url = gw.url + "/v1/completions"
        async with (
            httpx.AsyncClient(timeout=30, headers=auth(KEY)) as c,
            c.stream("POST", url, json=body("error")) as r,
        ):
            assert r.status_code == 200
            lines, texts = r.aiter_lines(), []  # read by hand: leaving a loop would close it
            while len(texts) < 3:
                line = await anext(lines)
                if line.startswith("data: {"):
                    texts.append(json.loads(line[6:])["choices"][0]["text"])
            # The continuation waits a minute for its first byte: the gateway is in its open.
            deadline = time.monotonic() + 10
            while not any("resume" in b for b in seen) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert sorted(held(gw).values()) == [0, 1], held(gw)  # the continuation's replica
            return texts  # and the client leaves

    assert asyncio.run(leave_during_the_failover()) == ["a", "b", "c"]
    assert [b["resume"]["output_token_ids"] for b in seen if "resume" in b] == [[1, 2, 3]]
    wait_all_given_back(gw)


@pytest.mark.parametrize("breaking", ["malformed-choice", "malformed-ids", "malformed-usage"])
def test_a_chunk_the_relay_cannot_read_breaks_the_stream_and_it_goes_on_elsewhere(relay, breaking):
    gw, seen = relay
    text, finishes, errors = "", [], []
    with httpx.stream("POST", gw.url + "/v1/completions", json=body(breaking), headers=auth(KEY)) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines:
        if line.startswith("data: {"):
            obj = json.loads(line[6:])
            errors += [obj["error"]] if "error" in obj else []
            for ch in obj.get("choices", []):
                text += ch["text"]
                finishes += [ch["finish_reason"]] if ch["finish_reason"] else []
    assert not errors and text == "abc rest" and finishes == ["length"]
    resumes = [b["resume"] for b in seen if "resume" in b]
    assert [(r["prompt_token_ids"], r["output_token_ids"]) for r in resumes] == [(PROMPT_IDS, [1, 2, 3])]
    wait_all_given_back(gw)
