"""Renders HF-style jinja2 chat templates."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def template_message(
    role: str, content: object, tool_calls: object = None, tool_call_id: object = None
) -> dict[str, Any]:
    """An OpenAI chat message as chat templates expect it: text parts joined, `developer` (the
    newer name of the system role) as `system`, an assistant's tool calls as {"id", "name",
    "arguments"} (see models.tool_formats for how they are rendered), a tool result's call id."""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content or ""}
    if isinstance(tool_calls, list) and tool_calls:
        out["tool_calls"] = [
            {"id": c.get("id"), "name": fn.get("name", ""), "arguments": fn.get("arguments", "{}")}
            for c in tool_calls
            if isinstance(c, dict)
            for fn in [c.get("function") if isinstance(c.get("function"), dict) else {}]
        ]
    if role == "tool":
        out["tool_call_id"] = tool_call_id
    return out


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


@lru_cache(maxsize=16)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    tools: list[dict] | None = None,
    **extra: Any,
) -> str:
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **(special_tokens or {}),
            **extra,
        )
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
