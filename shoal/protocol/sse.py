"""Server-sent events as OpenAI streams them: one JSON object per `data:` line, then [DONE]. The
replica writes them, the gateway reads them from replicas and writes them to its clients."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

SSE_DONE = "data: [DONE]\n\n"
DONE_DATA = "[DONE]"
_LINE_END = re.compile(r"\r\n|\r|\n")  # the only line ends an event stream has (the SSE spec)
# Line ends to str.splitlines (and so to httpx's aiter_lines and many clients) that JSON leaves
# unescaped: generated text holds them now and then, and a client splitting there reads half an
# event.
_UNICODE_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict) -> str:
    """One event."""
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_UNICODE_LINE_ENDS)}\n\n"


async def sse_lines(text: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of an event stream read as text chunks (httpx's aiter_text), ended by CR, LF or
    CRLF only: a server may send U+2028 raw inside an event, where aiter_lines would cut it."""
    pending = ""
    async for chunk in text:
        pending += chunk
        end = len(pending) - 1 if pending.endswith("\r") else len(pending)  # maybe half a CRLF
        start = 0
        for m in _LINE_END.finditer(pending, 0, end):
            yield pending[start : m.start()]
            start = m.end()
        pending = pending[start:]
    if pending:
        yield pending.removesuffix("\r")


def event_data(line: str) -> str | None:
    """The data of one line of a stream: None for a line that carries none (blank, a comment)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()
