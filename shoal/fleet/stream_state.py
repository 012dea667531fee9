"""What the gateway remembers of a stream it relays, so that it can continue it elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field

# Sampling fields carried over to a continuation request.
CARRIED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "user",
    "priority",
)


@dataclass
class StreamState:
    chat: bool  # the client's route: chat chunks or completion chunks
    body: dict  # the client's request
    client_wants_ids: bool = False
    id: str | None = None
    created: int | None = None
    model: str | None = None
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)  # tokens already streamed to the client
    text: str = ""  # text already streamed to the client
    finished: bool = False
    saw_token_ids: bool = False
    continuing: bool = False  # the current upstream is a continuation on /v1/completions
    base_tokens: int = 0  # tokens streamed before the current continuation began
    pending_text: str = ""  # text the dead replica held back, to send with the next chunk
    chunks: int = 0

    @property
    def can_continue(self) -> bool:
        return (
            self.body.get("n", 1) == 1
            and not self.finished
            and (self.chunks == 0 or (self.saw_token_ids and self.prompt_ids is not None))
        )

    def continuation_body(self) -> dict:
        b = self.body
        body = {k: b[k] for k in CARRIED if k in b}
        limit = b.get("max_completion_tokens") or b.get("max_tokens")
        if limit is None and not self.chat:
            limit = 16  # the completions API's default
        if limit is not None:
            body["max_tokens"] = max(1, limit - len(self.ids))
        if b.get("min_tokens"):
            body["min_tokens"] = max(0, b["min_tokens"] - len(self.ids))
        body.update(
            prompt=self.prompt_ids + self.ids,
            stream=True,
            stream_options={"include_usage": True},
            return_token_ids=True,
        )
        return body

    def begin_continuation(self, pending_text: str) -> None:
        self.continuing = True
        self.base_tokens = len(self.ids)
        self.pending_text = pending_text

    def relay(self, obj: dict) -> dict:
        """Records an upstream chunk and returns what the client should see."""
        self.chunks += 1
        if self.id is None:
            self.id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get("model")
        if self.prompt_ids is None:
            found = obj.get("prompt_token_ids")
            for ch in obj.get("choices") or []:
                found = ch.get("prompt_token_ids", found)
            self.prompt_ids = found
        if self.continuing:
            return self._translate(obj)
        for ch in obj.get("choices") or []:
            self._record(ch, ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content"))
            if not self.client_wants_ids:
                ch.pop("token_ids", None)
                ch.pop("prompt_token_ids", None)
        if not self.client_wants_ids:
            obj.pop("prompt_token_ids", None)
        return obj

    def _record(self, ch: dict, text: str | None) -> None:
        if "token_ids" in ch:
            self.saw_token_ids = True
            self.ids += ch["token_ids"]
        self.text += text or ""
        if ch.get("finish_reason"):
            self.finished = True

    def _translate(self, obj: dict) -> dict:
        """A continuation's completion chunk, in the client's format and under the original id."""
        head = {"id": self.id, "created": self.created, "model": self.model}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if obj.get("usage") and not obj.get("choices"):
            prompt = len(self.prompt_ids or [])
            done = self.base_tokens + obj["usage"]["completion_tokens"]
            usage = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            return {**head, "object": kind, "choices": [], "usage": usage}
        ch = obj["choices"][0]
        text = self.pending_text + (ch.get("text") or "")
        self.pending_text = ""
        self._record(ch, text)
        finish = ch.get("finish_reason")
        if self.chat:
            choice = {
                "index": 0,
                "delta": {"content": text} if text else {},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.client_wants_ids:
            choice["token_ids"] = ch.get("token_ids", [])
        return {**head, "object": kind, "choices": [choice]}
