"""How a model family writes tool calls, and how tools and past calls go into its prompt.

A chat template that knows tools (Hermes, Qwen, Llama 3.1 and later) renders them itself. One that
does not, as SmolLM2's bundled template, gets shoal's own rendering in SmolLM2's trained format:
the tools as JSON inside <tools> in the system turn, calls as a JSON list inside <tool_call>.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str | None  # the marker that opens a block of calls
    end: str | None  # the marker that closes it
    list_body: bool  # a block holds a JSON list of calls (SmolLM2), not one call (Hermes)
    args_key: str  # the key a call's arguments go under when shoal writes one
    bare_json: bool = False  # a call may open the answer with no marker (Llama 3 JSON)
    bare_prefixes: tuple[str, ...] = ()  # what may come before such a call
    args_keys: tuple[str, ...] = ("arguments", "parameters")  # keys read as arguments

    def call_text(self, calls: list[dict]) -> str:
        """Past calls ({"name", "arguments"} with arguments as JSON text) as the model writes them."""
        objs = [{"name": c["name"], self.args_key: _json_or_text(c["arguments"])} for c in calls]
        if self.list_body:
            return f"{self.start}{json.dumps(objs, ensure_ascii=False)}{self.end}"
        if self.start is not None:
            return "\n".join(f"{self.start}\n{json.dumps(o, ensure_ascii=False)}\n{self.end}" for o in objs)
        return "; ".join(json.dumps(o, ensure_ascii=False) for o in objs)

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) for output that is one call, or several if
        `parallel`, of one of `tools`, in this format."""
        schemas = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["name"]},
                    self.args_key: t.get("parameters") or {"type": "object", "properties": {}},
                },
                "required": ["name", self.args_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        # Fixed separators and no free whitespace (a weak model can loop on whitespace for ever),
        # laid out as `call_text` writes calls in the prompt.
        layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        spec = {"x-guidance": layout, "anyOf": schemas}
        call = f"call: %json {json.dumps(spec)}"
        if self.list_body:
            more = ' (", " call)*' if parallel else ""
            start = f"start: {_lark(self.start + '[')} call{more} {_lark(']' + self.end)}"
        elif self.start is not None:
            block = f"{_lark(self.start + chr(10))} call {_lark(chr(10) + self.end)}"
            start = f"start: block ({_lark(chr(10))} block)*" if parallel else "start: block"
            start += f"\nblock: {block}"
        else:
            start = 'start: call ("; " call)*' if parallel else "start: call"
        return f"{start}\n{call}"


SMOLLM2 = ToolFormat("smollm2", "<tool_call>", "</tool_call>", list_body=True, args_key="arguments")
HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", list_body=False, args_key="arguments")
LLAMA3_JSON = ToolFormat(
    "llama3_json",
    None,
    None,
    list_body=False,
    args_key="parameters",
    bare_json=True,
    bare_prefixes=("<|python_tag|>",),
)
FORMATS = {f.name: f for f in (SMOLLM2, HERMES, LLAMA3_JSON)}


def tool_format(name: str, chat_template: str | None) -> ToolFormat:
    """The named format, or for "auto" the one the chat template writes."""
    if name != "auto":
        if name not in FORMATS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose from auto, {', '.join(FORMATS)}")
        return FORMATS[name]
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    return SMOLLM2


def function_spec(function: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function definition as the prompt shows it (one spelling for the server and for
    the gateway, whose prefix hashes must agree with the server's)."""
    return {k: function[k] for k in ("name", "description", "parameters") if function.get(k) is not None}


def offered_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The functions a raw chat request offers the model: none when tool_choice is "none"."""
    tools = body.get("tools")
    if not isinstance(tools, list) or body.get("tool_choice") == "none":
        return []
    return [
        function_spec(t["function"])
        for t in tools
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def _json_or_text(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _lark(literal: str) -> str:
    return json.dumps(literal)


def _system_text(tools: list[dict], fmt: ToolFormat) -> str:
    """The tools and how to call them, in the words of shoal and the format SmolLM2 learned."""
    listing = json.dumps(tools, ensure_ascii=False)
    example = fmt.call_text([{"name": "function_name", "arguments": '{"argument": "value"}'}])
    return (
        "You can call functions to answer. The functions you have are listed here:\n"
        f"<tools>{listing}</tools>\n\n"
        "To call functions, answer with the calls only, written exactly like this and with no "
        f"other text:\n{example}\n"
        "Give each argument the type its parameter asks for. If no function fits the question, "
        "or the question lacks a value a function needs, say so in plain words instead."
    )


def conversation(
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    fmt: ToolFormat,
    chat_template: str | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Template-ready messages and template arguments for a conversation that may hold tools,
    calls and tool results. `messages` come from `template_message`; `tools` are OpenAI function
    definitions ({"name", "description", "parameters"})."""
    if template_knows_tools(chat_template):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {
                    **m,
                    "tool_calls": [
                        {
                            "id": c.get("id"),
                            "type": "function",
                            "function": {"name": c["name"], "arguments": _json_or_text(c["arguments"])},
                        }
                        for c in m["tool_calls"]
                    ],
                }
            out.append(m)
        wrapped = [{"type": "function", "function": t} for t in tools] if tools else None
        return out, {"tools": wrapped}
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            text = "\n".join(p for p in (m.get("content") or "", fmt.call_text(calls)) if p)
            m = {"role": m["role"], "content": text}
        elif "tool_call_id" in m:
            m = {"role": m["role"], "content": m.get("content") or ""}
        out.append(m)
    if tools:
        system = _system_text(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}
