"""Structured output: a grammar decides which tokens a request may sample next.

Built on llguidance. Measured on the 2-core Zen 3 here with the bundled tokenizer and a nested
JSON schema, xgrammar computed a mask in 6-7 us per token against llguidance's 55-62 us, but it
requires transformers and triton in the default install; llguidance requires nothing, compiles a
schema in 1.3 ms (xgrammar: 7 ms), and its 60 us is under 1% of a decode step here. Its parser
runs on fuel limits, so a grammar too costly to compile or to step is refused, never hung on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from shoal.engine.sampling_params import InvalidParamError

# What JSON itself allows between tokens, for a request that opts into free whitespace.
FREE_WHITESPACE = r"[\x20\x0A\x0D\x09]+"
JSON_KINDS = ("json_object", "json_schema")
WHITESPACE_FIELD = "guided_whitespace_pattern"


@dataclass(frozen=True)
class StructuredOutput:
    """kind: "json_object", "json_schema", "regex", "choice" or "grammar". spec: the schema as JSON
    text, the regex, the choices as a JSON list, or a Lark / GBNF grammar (empty for json_object).

    `whitespace` (JSON only): a regex of the whitespace allowed between the JSON's tokens. None
    allows none, the way OpenAI's strict mode writes JSON: left free, a small model spends its
    max_tokens on newlines and runs of spaces (on the bundled model 8 answers in 9 came back cut;
    see benchmarks/structured_whitespace.py). A schema's own "x-guidance" options still apply."""

    kind: str
    spec: str = ""
    param: str = "response_format"  # the request field it came from, for error messages
    whitespace: str | None = None

    def grammar(self) -> str:
        """The llguidance grammar, checked; InvalidParamError naming the problem otherwise. Built
        once: the server checks it before admission, and the engine's matcher reuses it."""
        return self._checked_grammar

    @functools.cached_property  # a frozen dataclass still has an instance __dict__ to cache in
    def _checked_grammar(self) -> str:
        import llguidance

        from_ = llguidance.LLMatcher
        try:
            if self.kind in JSON_KINDS:
                schema = self.spec if self.kind == "json_schema" else '{"type": "object"}'
                free = {"whitespace_pattern": self.whitespace} if self.whitespace is not None else None
                grammar = from_.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": False}, overrides=free
                )
            elif self.kind == "regex":
                grammar = from_.grammar_from_regex(self.spec)
            elif self.kind == "choice":
                grammar = llguidance.grammar_from("choice", self.spec)
            else:
                grammar = llguidance.grammar_from("grammar", self.spec)
        except (ValueError, TypeError) as exc:
            raise InvalidParamError(f"invalid {self.kind.replace('_', ' ')}: {exc}", self.param) from None
        error = from_.validate_grammar(grammar)
        if error:
            raise InvalidParamError(f"invalid {self.kind.replace('_', ' ')}: {error[:500]}", self.param)
        return grammar


def unpack_bitmask(packed: torch.Tensor) -> torch.Tensor:
    """[..., words] int32 bitmasks (32 tokens a word, lowest bit first: llguidance's layout) as
    [..., words * 32] bools. Unpacked here rather than through llguidance.torch, whose
    torch.compile'd helper costs seconds to import and to run once."""
    bits = (packed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(-2).bool()


class GrammarBackend:
    """Matchers for one tokenizer (a `tokenizers.Tokenizer`). Its token table is built on first
    use (~0.25 s), so an engine that never sees a grammar never pays for it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = eos_token_ids
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shoal-grammar")

    @functools.cached_property
    def tokenizer(self):
        import llguidance

        table = self._hf_tokenizer.to_str()
        return llguidance.LLTokenizer(table, n_vocab=self.vocab_size, eos_token=self._eos)

    def matcher(self, structured: StructuredOutput, prior_tokens: list[int]) -> Any:
        """A matcher that has consumed `prior_tokens` (a resumed request's output so far)."""
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, structured.grammar(), log_level=0)
        if prior_tokens:
            m.consume_tokens(prior_tokens)
        if m.is_error():  # a matcher never raises; it enters an error state and stays there
            raise InvalidParamError(f"structured output: {m.get_error()[:500]}", structured.param)
        return m

    def fill(self, matcher: Any) -> torch.Tensor:
        """The bitmask of tokens `matcher` allows next: one bit per token, 32 to an int32 word,
        lowest bit first (llguidance's layout)."""
        words = -(-self.vocab_size // 32)
        mask = torch.full((words,), -1, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
        return mask

    def prefetch(self, matcher: Any) -> Future:
        """The next mask, computed on the grammar thread while the forward pass runs (llguidance
        and the model's kernels both run without the GIL)."""
        return self._pool.submit(self.fill, matcher)

    @staticmethod
    def apply(logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> None:
        """Masks, in place, the tokens each row's bitmask forbids (logits on the host)."""
        allowed = unpack_bitmask(torch.stack(masks))[:, : logits.shape[1]]
        sub = logits[rows]
        sub[:, : allowed.shape[1]].masked_fill_(~allowed, float("-inf"))
        sub[:, allowed.shape[1] :] = float("-inf")  # ids past the grammar's vocabulary are never text
        logits[rows] = sub


def parse_request_structure(fields: dict[str, Any]) -> StructuredOutput | None:
    """The one structured-output constraint an OpenAI request asks for (response_format, vLLM's
    guided_* fields, or structured_outputs), or None; two at once is a 400."""
    found: list[StructuredOutput] = []
    rf = fields.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        kind = rf.get("type")
        if kind == "json_object":
            found.append(StructuredOutput("json_object"))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidParamError(
                    "response_format.json_schema.schema must be an object", "response_format"
                )
            found.append(StructuredOutput("json_schema", json.dumps(schema)))
        else:
            raise InvalidParamError(
                f"response_format type {str(kind)[:40]!r} is not supported", "response_format"
            )
    so = fields.get("structured_outputs")
    guided = {
        "guided_json": ("json_schema", fields.get("guided_json")),
        "guided_regex": ("regex", fields.get("guided_regex")),
        "guided_choice": ("choice", fields.get("guided_choice")),
        "guided_grammar": ("grammar", fields.get("guided_grammar")),
    }
    if isinstance(so, dict):
        for key, kind in (
            ("json", "json_schema"),
            ("regex", "regex"),
            ("choice", "choice"),
            ("grammar", "grammar"),
        ):
            if so.get(key) is not None:
                guided[f"structured_outputs.{key}"] = (kind, so[key])
    elif so is not None:
        raise InvalidParamError("structured_outputs must be an object", "structured_outputs")
    for name, (kind, value) in guided.items():
        if value is None:
            continue
        if kind == "json_schema" and isinstance(value, dict | bool):
            value = json.dumps(value)
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise InvalidParamError(f"{name} must be a non-empty list of strings", name.split(".")[0])
            value = json.dumps(value)
        elif not isinstance(value, str):
            raise InvalidParamError(f"{name} must be a string", name.split(".")[0])
        found.append(StructuredOutput(kind, value, name.split(".")[0]))
    if len(found) > 1:
        raise InvalidParamError("ask for one structured-output constraint at a time", found[1].param)
    whitespace = _whitespace_pattern(fields, so)
    if whitespace is None:
        return found[0] if found else None
    if not found or found[0].kind not in JSON_KINDS:
        raise InvalidParamError("a whitespace pattern applies to JSON output only", WHITESPACE_FIELD)
    return dataclasses.replace(found[0], whitespace=whitespace)


def _whitespace_pattern(fields: dict[str, Any], so: Any) -> str | None:
    """vLLM's opt-in to whitespace in JSON output: `guided_whitespace_pattern`, or
    `structured_outputs.whitespace_pattern`, a regex of what may stand between tokens."""
    value = fields.get(WHITESPACE_FIELD)
    if isinstance(so, dict) and so.get("whitespace_pattern") is not None:
        value = so["whitespace_pattern"]
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidParamError("the whitespace pattern must be a non-empty regex", WHITESPACE_FIELD)
    return value
