"""An event stream's lines end at CR, LF or CRLF only (the SSE spec), while generated text may hold
U+2028, U+2029 or U+0085, which JSON leaves raw and str.splitlines (httpx's aiter_lines, and many
clients) treats as line ends. A gateway that split there read half an event from a replica and
failed a healthy stream over (seen once in the rolling-update test: 1,587 tokens into a long
stream). Here a stand-in replica sends such characters raw, with CRLF line ends, and the real
gateway relays every event whole, escaped for its own clients."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse

from shoal.protocol.sse import sse, sse_lines
from tests.fleet_helpers import metric, start_gateway
from tests.server_helpers import StandIn, stand_in_app

PIECES = ["Once", " a\u2028b", " c\u2029d", " e\x85f", " g\x1ch", "\u2028", " end"]


def raw_event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\r\n\r\n"  # U+2028 and the rest left raw


def stand_in() -> StandIn:
    app = stand_in_app()

    @app.post("/v1/completions")
    async def completions(_: Request):

        async def events():
            for i, piece in enumerate(PIECES):
                yield raw_event(
                    {
                        "id": "cmpl-x",
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": piece, "token_ids": [i]}],
                    }
                )
            usage = {"prompt_tokens": 1, "completion_tokens": len(PIECES), "total_tokens": 1 + len(PIECES)}
            last = {"index": 0, "text": "", "finish_reason": "length"}
            yield raw_event({"id": "cmpl-x", "object": "text_completion", "choices": [last], "usage": usage})
            yield "data: [DONE]\r\n\r\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return StandIn(app)


def test_events_with_unicode_line_separators_are_relayed_whole():
    backend = stand_in()
    gw = start_gateway([backend.url])
    try:
        body = {"model": "m", "prompt": "x", "max_tokens": len(PIECES), "stream": True}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            # A client that splits as str.splitlines does reads every event whole: the gateway
            # escapes what its replica sent raw.
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join(ch["text"] for e in events for ch in e["choices"])
        assert text == "".join(PIECES)
        assert "error" not in events[-1] and events[-1]["choices"][0]["finish_reason"] == "length"
        assert metric(gw.url, "shoal:gateway_failovers_total") == 0  # no stream was taken for broken
    finally:
        gw.stop()
        backend.close()


def test_an_event_is_escaped_and_lines_split_at_cr_lf_or_crlf_only_wherever_chunks_break():
    event = sse({"text": "a\u2028b\x85c\u2029d"})
    assert event.splitlines() == [event.rstrip("\n"), ""]  # one line, however a client splits it
    assert json.loads(event[6:])["text"] == "a\u2028b\x85c\u2029d"

    async def lines(chunks: list[str]) -> list[str]:
        async def text():
            for c in chunks:
                yield c

        return [line async for line in sse_lines(text())]

    stream = "data: 1\r\ndata: 2\u2028x\rdata: 3\n\r\ndata: 4"
    want = ["data: 1", "data: 2\u2028x", "data: 3", "", "data: 4"]
    for cut in range(len(stream) + 1):  # a CRLF split across two chunks is one line end
        assert asyncio.run(lines([stream[:cut], stream[cut:]])) == want, cut
