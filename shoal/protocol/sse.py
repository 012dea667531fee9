"""Server-sent events as OpenAI streams them: one JSON object per `data:` line, then [DONE]. The
replica writes them, the gateway reads them from replicas and writes them to its clients."""

from __future__ import annotations

import json

SSE_DONE = "data: [DONE]\n\n"
DONE_DATA = "[DONE]"


def sse(payload: dict) -> str:
    """One event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def event_data(line: str) -> str | None:
    """The data of one line of a stream: None for a line that carries none (blank, a comment)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()
