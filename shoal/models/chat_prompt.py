"""A chat request's prompt as token ids: the one rendering that a replica runs (server/chat.py)
and that the gateway runs for its routing keys (fleet/routing/prompt_keys.py), so that both come
to the same tokens, and the gateway's block hashes are the replica's own."""

from __future__ import annotations

from typing import Any

from shoal.models.chat_template import template_message
from shoal.models.tokenizer import Tokenizer
from shoal.models.tool_formats import ToolFormat, conversation


def raw_messages(messages: list) -> list[dict[str, Any]]:
    """Template messages from a raw (unvalidated) request's `messages`."""
    flat = [m if isinstance(m, dict) else {} for m in messages]
    return [
        template_message(m.get("role", "user"), m.get("content"), m.get("tool_calls"), m.get("tool_call_id"))
        for m in flat
    ]


def chat_token_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    fmt: ToolFormat,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The conversation (messages from `template_message`) with `tools` offered to the model in
    `fmt`'s way (its chat template's own, or shoal's system text), rendered and tokenized.
    Raises ChatTemplateError for a conversation the template refuses."""
    rendered, kwargs = conversation(messages, tools, fmt, tokenizer.chat_template)
    return tokenizer.encode_chat(rendered, add_generation_prompt=add_generation_prompt, **kwargs)
