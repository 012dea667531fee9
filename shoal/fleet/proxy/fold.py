"""A non-streamed completion relayed as a stream, and folded back into the one answer its client
asked for. Relayed so, it is what a stream is to the gateway: its tokens known as they come, so
it can go on elsewhere from where it was when its replica dies, and be moved live (a drain, a
rebalance), instead of running again from the start. The answer is the replica's own non-streamed
answer: the same fields, built from its chunks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.fleet.proxy.stream_state import prompt_count

_LEGACY_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def foldable(path: str, body: dict) -> bool:
    """Whether a non-streamed request can be relayed as a stream and answered the same."""
    if body.get("stream") not in (None, False) or "stream_options" in body:
        return False  # the replica answers a misuse of either itself, as it would have
    if path.endswith("/chat/completions"):
        return True
    if not path.endswith("/completions"):
        return False
    # Echoed prompts of several choices do not stream (the server refuses them).
    n = body.get("n")
    return not (body.get("echo") and isinstance(n, int) and n > 1)


def streamed(body: dict) -> dict:
    """The body sent upstream in place of the client's."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


@dataclass
class _Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    content_logprobs: list = field(default_factory=list)
    legacy_logprobs: dict[str, list] = field(default_factory=lambda: {k: [] for k in _LEGACY_LOGPROBS})
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    tool_calls: dict[int, dict] = field(default_factory=dict)  # by the call's index


class StreamFold:
    """Chunks in (as the client of a stream would see them), one answer out."""

    def __init__(self, path: str, body: dict):
        self.chat = path.endswith("/chat/completions")
        lp = body.get("logprobs")
        self.want_logprobs = bool(lp) if self.chat else lp is not None
        self.want_ids = bool(body.get("return_token_ids"))
        n = body.get("n") if isinstance(body.get("n"), int) else 1
        # Every choice answers, even one whose stream said nothing.
        self.choices = {i: _Choice(i) for i in range(n * prompt_count(path, body))}
        self.head: dict | None = None
        self.usage: dict | None = None

    def add(self, obj: dict) -> None:
        if self.head is None:
            skip = ("object", "choices", "usage", "prompt_token_ids")
            self.head = {k: v for k, v in obj.items() if k not in skip}
        if obj.get("usage") is not None:
            self.usage = obj["usage"]
        for ch in obj.get("choices") or []:
            index = ch.get("index", 0)
            c = self.choices.setdefault(index, _Choice(index))
            prompt = ch.get("prompt_token_ids") or obj.get("prompt_token_ids")
            if prompt is not None and c.prompt_token_ids is None:
                c.prompt_token_ids = prompt
            c.token_ids += ch.get("token_ids") or []
            if ch.get("finish_reason"):
                c.finish_reason = ch["finish_reason"]
            if self.chat:
                self._add_chat(c, ch)
            else:
                self._add_text(c, ch)

    def _add_chat(self, c: _Choice, ch: dict) -> None:
        delta = ch.get("delta") or {}
        c.text += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            into = c.tool_calls.setdefault(
                call.get("index", len(c.tool_calls)),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id"):
                into["id"] = call["id"]
            fn = call.get("function") or {}
            into["function"]["name"] += fn.get("name") or ""
            into["function"]["arguments"] += fn.get("arguments") or ""
        lp = ch.get("logprobs")
        if isinstance(lp, dict):
            c.content_logprobs += lp.get("content") or []

    def _add_text(self, c: _Choice, ch: dict) -> None:
        c.text += ch.get("text") or ""
        lp = ch.get("logprobs")
        if isinstance(lp, dict):
            for k in _LEGACY_LOGPROBS:
                c.legacy_logprobs[k] += lp.get(k) or []

    def answer(self, prompt_ids_for: Callable[[int], list[int] | None]) -> dict:
        """`prompt_ids_for`: a choice's prompt ids where its own chunks did not say them (it was
        continued elsewhere before they came)."""
        for i, c in self.choices.items():
            if c.prompt_token_ids is None:
                c.prompt_token_ids = prompt_ids_for(i)
        choices = [self._choice(self.choices[i]) for i in sorted(self.choices)]
        kind = "chat.completion" if self.chat else "text_completion"
        return {**(self.head or {}), "object": kind, "choices": choices, "usage": self.usage}

    def _choice(self, c: _Choice) -> dict:
        out: dict = {"index": c.index}
        if self.chat:
            out["message"] = self._message(c)
            out["logprobs"] = {"content": c.content_logprobs, "refusal": None} if self.want_logprobs else None
        else:
            out["text"] = c.text
            out["logprobs"] = c.legacy_logprobs if self.want_logprobs else None
        out["finish_reason"] = c.finish_reason
        if self.want_ids:
            out.update(token_ids=c.token_ids, prompt_token_ids=c.prompt_token_ids)
        return out

    def _message(self, c: _Choice) -> dict:
        if not c.tool_calls:
            return {"role": "assistant", "content": c.text, "refusal": None}
        calls = [c.tool_calls[k] for k in sorted(c.tool_calls)]
        return {"role": "assistant", "content": c.text or None, "refusal": None, "tool_calls": calls}
