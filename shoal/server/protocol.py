"""OpenAI request bodies (pydantic) and their translation into engine sampling parameters."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from shoal.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidParamError,
    SamplingParams,
)
from shoal.engine.structured import StructuredOutput, parse_request_structure
from shoal.models.chat_template import template_message
from shoal.models.tool_formats import function_spec
from shoal.protocol.bodies import STRUCTURED_FIELDS
from shoal.protocol.resume import Resume, TokenId, TokenIds
from shoal.protocol.seeds import SEED_MAX, SEED_MIN

# Prompts in one completions request (each is an engine request, times n).
MAX_PROMPTS = 64
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs in one embeddings request
MAX_TOOLS = 128  # OpenAI's limit on tools in one request
# OpenAI fields shoal does not implement yet. Ignoring them would hand a client plain text where
# it asked for a tool call or JSON, so each is refused by name; the value that means "off" passes.
UNSUPPORTED = {
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do, so newer SDKs keep working.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's spec marks most optional fields nullable ("stream": null, "n": null), and SDKs
        # send null for "not given": a null takes the field's default instead of failing its type.
        if isinstance(data, dict):
            fields = cls.model_fields
            return {
                k: v
                for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None
            }
        return data


class KVTransferParams(_Request):
    """shoal's extension for a fleet's gateway splitting prefill from decode (vLLM's field of the
    same name does the same job): `do_remote_decode` asks a prefill worker to keep the prompt's
    K/V for a decode worker; `source` and `handle` tell a decode worker where to pull it from;
    `source` and `prefix` tell a replica which peer holds blocks of the prompt's prefix, to fetch
    instead of computing them. Only the gateway may send it (it carries the fleet's transfer key)."""

    do_remote_decode: StrictBool = False
    source: Annotated[StrictStr, Field(max_length=2048, pattern=r"^https?://")] | None = None
    handle: Annotated[StrictStr, Field(max_length=256)] | None = None
    host: Annotated[StrictStr, Field(max_length=512)] | None = None
    prefix: StrictBool = False

    @model_validator(mode="after")
    def _one_side(self):
        if self.do_remote_decode == (self.source is not None):
            raise InvalidParamError(
                "kv_transfer_params: give either do_remote_decode or source and handle", "kv_transfer_params"
            )
        if self.source is not None and (self.handle is None) != self.prefix:
            raise InvalidParamError(
                "kv_transfer_params: source needs a handle, or prefix (not both)", "kv_transfer_params"
            )
        return self


class StreamOptions(_Request):
    include_usage: StrictBool = False


class _SamplingFields(_Request):
    model: StrictStr
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # Extensions shared with vLLM.
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    ignore_eos: StrictBool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    logit_bias: Annotated[dict[StrictStr, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 18)] | None = None
    # Lower runs first. A client can only lower its own priority unless the server trusts it.
    priority: Annotated[StrictInt, Field(ge=-(2**31), le=2**31)] = 0
    resume: Resume | None = None
    kv_transfer_params: KVTransferParams | None = None

    unsupported: ClassVar[dict] = UNSUPPORTED

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, is_off in cls.unsupported.items():
                if not is_off(data.get(name)):
                    raise InvalidParamError(f"{name} is not supported by this server yet", name)
        return data

    # Structured output: OpenAI's response_format, and vLLM's guided_* and structured_outputs.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: dict[str, Any] | None = None
    # JSON output has no whitespace between tokens unless this regex allows some (vLLM's name).
    guided_whitespace_pattern: StrictStr | None = None

    def structured(self) -> StructuredOutput | None:
        """The grammar the output must follow, checked (a 400 naming the problem otherwise)."""
        found = parse_request_structure(
            {name: getattr(self, name) for name in STRUCTURED_FIELDS if getattr(self, name) is not None}
        )
        if found is not None:
            found.grammar()  # compiles within llguidance's fuel limits, or raises
        return found

    @model_validator(mode="after")
    def _resume_one_choice(self):
        if self.resume is not None and self.n != 1:
            raise InvalidParamError("resume continues one choice: n must be 1", "n")
        kv = self.kv_transfer_params
        if kv is not None and kv.do_remote_decode and (self.stream or self.n != 1):
            raise InvalidParamError("a remote prefill (do_remote_decode) is one unstreamed choice", "stream")
        return self

    # shoal's extension (vLLM has the same): token ids of the prompt and of every delta, which a
    # gateway needs to continue a stream on another replica token for token.
    return_token_ids: StrictBool = False

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, **extra: Any) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            structured=self.structured(),
            **extra,
        )

    def _logit_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise InvalidParamError(f"logit_bias keys are token ids; got {key[:20]!r}", "logit_bias")
            bias[int(key)] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: (
        StrictStr
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    # 0 scores the prompt (with echo and logprobs) without generating.
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class FunctionName(_Request):
    name: StrictStr


class FunctionDefinition(_Request):
    # OpenAI's rule for function names; it keeps them safe inside a grammar and a prompt.
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def as_tool(self) -> dict[str, Any]:
        return function_spec(self.model_dump())


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Request):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        # An image or audio part would otherwise fail as a shapeless type error.
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            for part in data["content"]:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise InvalidParamError(
                        f"content parts of type {kind[:40]!r} are not supported: this model reads text only",
                        "messages",
                    )
        return data

    @model_validator(mode="after")
    def _calls_from_the_assistant(self):
        if self.tool_calls and self.role != "assistant":
            raise InvalidParamError("only assistant messages carry tool_calls", "messages")
        return self

    def as_template_message(self) -> dict[str, Any]:
        parts = self.content if not isinstance(self.content, list) else [p.model_dump() for p in self.content]
        calls = [c.model_dump() for c in self.tool_calls] if self.tool_calls else None
        return template_message(self.role, parts, calls, self.tool_call_id)


class ChatCompletionRequest(_SamplingFields):
    unsupported: ClassVar[dict] = {k: v for k, v in UNSUPPORTED.items() if k not in ("tools", "tool_choice")}
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise InvalidParamError("tools must have distinct function names", "tools")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise InvalidParamError("tool_choice asks for a tool call, but no tools are given", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidParamError(
                f"tool_choice names {choice.function.name[:64]!r}, which is not among the tools",
                "tool_choice",
            )
        if self.forced_tools and any(getattr(self, f) is not None for f in STRUCTURED_FIELDS):
            raise InvalidParamError(
                "a required or named tool_choice constrains the output itself; it cannot be combined "
                "with response_format or guided decoding",
                "tool_choice",
            )
        return self

    @property
    def active_tools(self) -> list[dict[str, Any]]:
        """The tools the model is offered: none when tool_choice is "none"."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.function.as_tool() for t in self.tools]

    @property
    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools the output must call one of (required, or the named one), or None."""
        choice = self.tool_choice
        if choice == "required":
            return self.active_tools
        if isinstance(choice, NamedToolChoice):
            return [t for t in self.active_tools if t["name"] == choice.function.name]
        return None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(_Request):
    model: StrictStr
    input: (
        StrictStr
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    # The first `dimensions` of the embedding, normalized again.
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None
    user: StrictStr | None = None
    priority: Annotated[StrictInt, Field(ge=-(2**31), le=2**31)] = 0

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]
        return list(x)


class TokenizeRequest(_Request):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class LoadLoRAAdapterRequest(_Request):
    lora_name: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    lora_path: Annotated[StrictStr, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(_Request):
    lora_name: Annotated[StrictStr, Field(min_length=1, max_length=256)]


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]
    skip_special_tokens: StrictBool = False
