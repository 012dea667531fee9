"""Reads tool calls out of a model's text as it streams.

What the parser has emitted after reading a text depends on that text alone, never on how it was
cut into deltas. So a non-streamed answer (the whole text read at once) is the streamed one
reassembled, and a resumed stream replays its prior text silently and goes on where it stopped.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

from shoal.models.tool_formats import ToolFormat

_WS = " \t\r\n"
_ID_CHARS = string.ascii_letters + string.digits


def tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class CallDelta:
    """One step of one call, as OpenAI streams it: the first carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict:
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        out: dict = {"index": self.index, "function": fn}
        if self.id is not None:
            out.update(id=self.id, type="function")
        return out


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass
class _Value:
    start: int
    end: int | None = None  # None: not finished in the text so far


@dataclass
class _ObjectScan:
    """Top-level members of a JSON object prefix: key -> where its value lies."""

    members: dict[str, _Value] = field(default_factory=dict)
    end: int | None = None  # index just past the closing brace
    broken: bool = False  # not a JSON object


def _scan_string(text: str, i: int) -> int | None:
    """Index past the string literal opening at text[i] (a quote), or None if it is unfinished."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _scan_value(text: str, i: int) -> tuple[int | None, bool]:
    """(index past the JSON value at text[i] or None if unfinished, broken)."""
    c = text[i]
    if c == '"':
        return _scan_string(text, i), False
    if c in "{[":
        closers = []
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _scan_string(text, i)
                if end is None:
                    return None, False
                i = end
                continue
            if c in "{[":
                closers.append("}" if c == "{" else "]")
            elif c in "}]":
                if not closers or closers.pop() != c:
                    return None, True
                if not closers:
                    return i + 1, False
            i += 1
        return None, False
    j = i
    while j < len(text) and (text[j].isalnum() or text[j] in "+-."):
        j += 1
    if j == i:
        return None, True
    return (j if j < len(text) else None), False


def scan_object(text: str, start: int) -> _ObjectScan:
    """Scans the JSON object opening at text[start] as far as the text goes."""
    scan = _ObjectScan()
    i, n = start + 1, len(text)

    def skip(k: int) -> int:
        while k < n and text[k] in _WS:
            k += 1
        return k

    while True:
        i = skip(i)
        if i >= n:
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            scan.broken = True
            return scan
        key_end = _scan_string(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            scan.broken = True
            return scan
        i = skip(key_end)
        if i >= n:
            return scan
        if text[i] != ":":
            scan.broken = True
            return scan
        i = skip(i + 1)
        if i >= n:
            return scan
        value = _Value(i)
        scan.members[key] = value
        end, broken = _scan_value(text, i)
        if broken:
            scan.broken = True
            return scan
        if end is None:
            return scan
        value.end = end
        i = end


class ToolCallParser:
    """Feeds on a choice's text; returns content and tool-call deltas as soon as they are sure."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.text = ""
        self.pos = 0  # text before this is decided: emitted as content or read as calls
        self.state = "outside"  # outside | block | object
        self.calls: list[CallDelta] = []  # every call so far, merged
        self._block_start = 0
        self._block_calls = 0
        self._bare = False  # the block had no marker (Llama 3 JSON)
        self._obj_start = 0
        self._call: int | None = None  # index of the object's call once its name is read
        self._args_sent = 0
        self._held_ws = ""  # whitespace after content, sent once more content follows

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str) -> ParsedDelta:
        self.text += delta
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """Whatever was held back: an unfinished marker or a block that never became a call."""
        out = ParsedDelta()
        if self.state == "outside":
            self._content(out, self.text[self.pos :])
        elif self._block_calls == 0:
            self._content(out, self.text[self._block_start :])
        elif self.state == "object" and self._call is None:
            self._content(out, self.text[self._obj_start :])
        self.pos = len(self.text)
        if self._held_ws and not self.called:
            out.content += self._held_ws
        self._held_ws = ""
        return out

    # --- one step of the state machine; True when it moved --------------------------------

    def _step(self, out: ParsedDelta) -> bool:
        if self.state == "outside":
            return self._outside(out)
        if self.state == "block":
            return self._in_block(out)
        return self._in_object(out)

    def _content(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        body = text.rstrip(_WS)
        if not body:
            self._held_ws += text
            return
        out.content += self._held_ws + body
        self._held_ws = text[len(body) :]

    def _outside(self, out: ParsedDelta) -> bool:
        text, fmt = self.text, self.fmt
        rest = text[self.pos :]
        if not rest:
            return False
        if fmt.bare_json and self.pos == 0:
            # A Llama 3 call opens the answer: {"name": ...}, perhaps after its python tag.
            lead = rest.lstrip(_WS)
            for tag in fmt.bare_prefixes:
                if lead.startswith(tag):
                    lead = lead[len(tag) :].lstrip(_WS)
                elif tag.startswith(lead):
                    return False  # might still become the tag
            if not lead:
                return False
            if lead[0] == "{":
                self._open_block(self.pos, len(text) - len(lead), bare=True)
                return True
        if fmt.start is None:
            self._content(out, rest)
            self.pos = len(text)
            return False
        k = rest.find(fmt.start)
        if k >= 0:
            self._content(out, rest[:k])
            self._open_block(self.pos + k, self.pos + k + len(fmt.start), bare=False)
            return True
        keep = _partial_suffix(rest, fmt.start)
        self._content(out, rest[: len(rest) - keep])
        self.pos = len(text) - keep
        return False

    def _open_block(self, block_start: int, body_start: int, bare: bool) -> None:
        self.state = "block"
        self._block_start = block_start
        self._block_calls = 0
        self._bare = bare
        self.pos = body_start

    def _close_block(self, at: int) -> None:
        self.state = "outside"
        self._bare = False
        self.pos = at

    def _give_up_block(self, out: ParsedDelta) -> bool:
        """The block is not tool calls after all: what is undecided of it becomes content."""
        start = self._block_start if self._block_calls == 0 else self.pos
        self._content(out, self.text[start:])
        self.pos = len(self.text)
        self.state = "outside"
        self._bare = False
        self._call = None
        return False

    def _in_block(self, out: ParsedDelta) -> bool:
        text, fmt = self.text, self.fmt
        i = self.pos
        while i < len(text) and (text[i] in _WS or text[i] in "[],;"):
            i += 1
        self.pos = i
        if i >= len(text):
            return False
        if text[i] == "{":
            self.state = "object"
            self._obj_start = i
            self._call = None
            self._args_sent = 0
            return True
        if fmt.end is not None and not self._bare:
            rest = text[i:]
            if rest.startswith(fmt.end):
                self._close_block(i + len(fmt.end))
                return True
            if fmt.end.startswith(rest):
                return False
        if self._bare and self._block_calls:
            self._close_block(i)  # text after a Llama 3 call is content
            return True
        return self._give_up_block(out)

    def _in_object(self, out: ParsedDelta) -> bool:
        scan = scan_object(self.text, self._obj_start)
        if scan.broken:
            return self._give_up_block(out)
        name = scan.members.get("name")
        if self._call is None and name is not None and name.end is not None:
            try:
                value = json.loads(self.text[name.start : name.end])
            except ValueError:
                value = None
            if not isinstance(value, str):
                return self._give_up_block(out)
            self._call = len(self.calls)
            delta = CallDelta(self._call, tool_call_id(), value)
            self.calls.append(CallDelta(delta.index, delta.id, delta.name))
            out.calls.append(delta)
            self._block_calls += 1
        if self._call is not None:
            args = next((scan.members[k] for k in self.fmt.args_keys if k in scan.members), None)
            if args is not None:
                upto = args.end if args.end is not None else len(self.text)
                piece = self.text[args.start + self._args_sent : upto]
                if args.end is None:
                    piece = piece.rstrip(_WS)  # trailing space may turn out to follow the value
                if piece:
                    self._args_sent += len(piece)
                    self._send_args(out, piece)
            elif scan.end is not None:
                self._send_args(out, "{}")  # a call without arguments takes none
        if scan.end is None:
            return False
        if self._call is None:
            return self._give_up_block(out)  # an object that names no function
        self._call = None
        self.state = "block"
        self.pos = scan.end
        return True

    def _send_args(self, out: ParsedDelta, piece: str) -> None:
        self.calls[self._call].arguments += piece
        if out.calls and out.calls[-1].index == self._call:
            out.calls[-1].arguments += piece
        else:
            out.calls.append(CallDelta(self._call, arguments=piece))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
