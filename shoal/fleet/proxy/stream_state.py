"""What the gateway remembers of a stream it relays, so that it can continue it elsewhere.

Per choice: its prompt's token ids, the output token ids and how much text the client has. When
the replica dies, each unfinished choice is resumed with the original body plus `resume` (shoal's
extension, on the same route: prompt ids, output ids so far, the choice's index and the text the
client already has), and the answers are merged back under the original id, created and model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.protocol.resume import RESUME_FIELD, resume_field


def prompt_count(path: str, body: dict) -> int:
    """How many prompts a request holds (completions take a list of them)."""
    if path.endswith("chat/completions"):
        return 1
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], str | list):
        return len(p)
    return 1


@dataclass
class ChoiceState:
    index: int
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)  # output tokens the client has
    text_len: int = 0  # characters of text the client has (an echoed prompt included)
    echo_len: int | None = None  # characters of echoed prompt, when known
    finished: bool = False
    reopened: int = 0  # continuations so far


@dataclass
class Tag:
    """Which upstream a chunk came from: the original request, or a resume of one choice."""

    resume_of: int | None = None  # choice index
    offset_shift: int = 0  # added to completion logprobs' text_offset (the text before the resume)


ORIGINAL = Tag()


class StreamState:
    def __init__(self, path: str, body: dict):
        self.path = path
        self.chat = path.endswith("chat/completions")
        self.body = body
        self.client_wants_ids = bool(body.get("return_token_ids"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.n = body.get("n", 1) if isinstance(body.get("n"), int) else 1
        self.prompts = prompt_count(path, body)
        self.choices = {i: ChoiceState(i) for i in range(self.n * self.prompts)}
        self.head: dict | None = None  # id, created, model of the first chunk
        self.events = 0  # events sent to the client
        self.saw_token_ids = False
        self.continued = False
        self.usage_sent = False
        self.cached_tokens = 0
        self.upstream_usage: tuple[int, int] = (0, 0)  # the original upstream's own usage chunk

    # --- what can be continued -----------------------------------------------------------

    @property
    def unfinished(self) -> list[int]:
        return [i for i, c in self.choices.items() if not c.finished]

    @property
    def all_finished(self) -> bool:
        return not self.unfinished

    def prompt_ids_for(self, index: int) -> list[int] | None:
        c = self.choices[index]
        if c.prompt_ids is not None:
            return c.prompt_ids
        p = index // self.n
        for other in self.choices.values():  # a sibling of the same prompt announced it
            if other.prompt_ids is not None and (self.chat or other.index // self.n == p):
                return other.prompt_ids
        prompt = self.body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, list) and p < len(prompt) and isinstance(prompt[p], list):
            return prompt[p]
        return None

    def prompt_text_for(self, index: int) -> str | None:
        prompt = self.body.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and index // self.n < len(prompt):
            p = prompt[index // self.n]
            return p if isinstance(p, str) else None
        return None

    def resume_body(self, index: int, prompt_ids: list[int]) -> tuple[dict, Tag]:
        """The original request, continuing choice `index` only."""
        c = self.choices[index]
        c.reopened += 1
        body = {k: v for k, v in self.body.items() if k not in ("n", "best_of", "echo")}
        output_text = c.text_len - (c.echo_len if c.echo_len is not None else 0)
        if self.body.get("echo") and c.echo_len is None:
            # The echoed prompt's length is unknown: claim all the text, so nothing is sent twice
            # (at worst a held-back partial character at the cut is lost).
            output_text = c.text_len
        body.update(stream=True, return_token_ids=True)
        body[RESUME_FIELD] = resume_field(prompt_ids, list(c.ids), index, max(0, output_text))
        self.continued = True
        return body, Tag(index, c.text_len)

    # --- chunks --------------------------------------------------------------------------

    def relay(self, tag: Tag, obj: dict) -> tuple[dict | None, int]:
        """Records an upstream chunk; returns what the client should see (None: nothing) and
        how many output tokens it carried."""
        if self.head is None:
            self.head = {k: obj.get(k) for k in ("id", "created", "model")}
        elif tag is not ORIGINAL or self.continued:
            obj.update(self.head)
        top_prompt = obj.pop("prompt_token_ids", None)
        if obj.get("usage") is not None and not obj.get("choices"):
            details = obj["usage"].get("prompt_tokens_details") or {}
            self.cached_tokens = max(self.cached_tokens, details.get("cached_tokens") or 0)
            if tag is ORIGINAL:
                u = obj["usage"]
                p, c = u.get("prompt_tokens"), u.get("completion_tokens")
                self.upstream_usage = (p if isinstance(p, int) else 0, c if isinstance(c, int) else 0)
            if tag is not ORIGINAL or self.continued or not self.include_usage:
                return None, 0
            self.usage_sent = True
            return obj, 0
        tokens = 0
        for ch in obj.get("choices") or []:
            index = tag.resume_of if tag.resume_of is not None else ch.get("index", 0)
            ch["index"] = index
            c = self.choices.get(index)
            if c is None:
                c = self.choices[index] = ChoiceState(index)
            prompt = ch.pop("prompt_token_ids", None) or top_prompt
            first = c.prompt_ids is None and tag is ORIGINAL
            if prompt is not None and c.prompt_ids is None:
                c.prompt_ids = prompt
                if self.client_wants_ids and tag is ORIGINAL:
                    (ch if not self.chat else obj)["prompt_token_ids"] = prompt
            ids = ch.get("token_ids")
            if ids is not None:
                self.saw_token_ids = True
                c.ids += ids
                tokens += len(ids)
                if not self.client_wants_ids:
                    del ch["token_ids"]
            text = ch.get("text") if not self.chat else (ch.get("delta") or {}).get("content")
            lp = ch.get("logprobs")
            if not self.chat and isinstance(lp, dict) and isinstance(lp.get("text_offset"), list):
                if first and self.body.get("echo") and c.prompt_ids is not None:
                    offsets = lp["text_offset"]
                    if len(offsets) > len(c.prompt_ids):
                        c.echo_len = offsets[len(c.prompt_ids)]
                if tag.offset_shift:
                    lp["text_offset"] = [o + tag.offset_shift for o in lp["text_offset"]]
            c.text_len += len(text or "")
            if ch.get("finish_reason"):
                c.finished = True
        self.events += 1
        return obj, tokens

    def token_counts(self) -> tuple[int, int]:
        """(prompt tokens, output tokens the client has), as far as the stream told them: from
        token ids, else (a server that sends none) from its own usage chunk."""
        prompts: dict[int, int] = {}
        for c in self.choices.values():
            p = 0 if self.chat else c.index // self.n
            if c.prompt_ids is not None:
                prompts[p] = len(c.prompt_ids)
        counted = sum(prompts.values()), sum(len(c.ids) for c in self.choices.values())
        return counted if any(counted) else self.upstream_usage

    def final_usage(self) -> dict | None:
        """The usage chunk the client asked for, when the upstream's own could not be relayed."""
        if not self.include_usage or self.usage_sent or self.head is None:
            return None
        prompt, done = self.token_counts()
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.head, "object": kind, "choices": [], "usage": usage}
