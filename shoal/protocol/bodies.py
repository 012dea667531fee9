"""Request bodies as both servers take them: a size limit before anything is read into memory,
and JSON parsed strictly (no NaN or Infinity, bounded nesting, no lone surrogates), so hostile
input gets a 400 or 413 in OpenAI's format instead of a 500 or a stalled event loop."""

from __future__ import annotations

import json
import math

from shoal.protocol.errors import APIError, error_body

DEFAULT_MAX_BODY_BYTES = 4 << 20
# A body over the limit is still read and dropped up to this size before the 413, so that an
# ordinary client still uploading sees the answer rather than a reset connection; past it, the
# connection is cut at once.
DRAIN_LIMIT_BYTES = 64 << 20
MAX_JSON_DEPTH = 64
# The request fields that ask for structured output (OpenAI's, and vLLM's guided_* extensions).
STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "guided_whitespace_pattern",
)


def _reject_constant(name: str):
    raise APIError(400, f"the request body is not valid JSON: {name} is not a JSON number")


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object, or an APIError (400) that says what is wrong with it."""
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_json_values(obj)
    return obj


def check_json_values(obj) -> None:
    """Walks a parsed body without recursion: bounded depth, finite numbers, encodable strings."""
    stack = [(obj, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path or "body")
                stack.append((v, depth + 1, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise APIError(400, f"{path}: the number is out of range", path or None)


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{path}: the string holds a lone UTF-16 surrogate", path or None) from None


class BodyLimitMiddleware:
    """Refuses a body past `max_bytes` with 413 before it is buffered, then replays what it read
    to the app (pure ASGI: streaming responses and disconnect detection pass through).

    Paths under a prefix of `path_limits` (file uploads) have their own limit instead, and their
    bodies stream to the app unbuffered: past the limit, the 413 goes out and the app reads a
    disconnect."""

    def __init__(
        self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES, path_limits: dict[str, int] | None = None
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        for prefix, limit in self.path_limits.items():
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return await self._streamed(scope, receive, send, limit)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > DRAIN_LIMIT_BYTES:
            return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks = []  # keep reading (up to a bound) without keeping: see DRAIN_LIMIT_BYTES
                if size > DRAIN_LIMIT_BYTES or not message.get("more_body"):
                    return await self._too_large(send)
                continue
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _streamed(self, scope, receive, send, limit: int):
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._too_large(send, limit)
        size, refused = 0, False

        async def counted():
            nonlocal size, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit:
                    refused = True
                    await self._too_large(send, limit)
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message):
            if not refused:  # the 413 went out already: the app's own answer is dropped
                await send(message)

        try:
            return await self.app(scope, counted, guarded)
        except Exception:
            if not refused:
                raise
            return None  # the app failed on the disconnect it was handed

    async def _too_large(self, send, limit: int | None = None) -> None:
        limit = self.max_bytes if limit is None else limit
        body = json.dumps(
            error_body(413, f"the request body is larger than {limit} bytes", code="body_too_large")
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body})
