"""Structured output on a real server: response_format and vLLM's guided fields constrain what the
bundled model writes, so the output always parses and validates; streamed and n > 1 too."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(chat_server):
    """The bundled model's server (see conftest), shared with test_tool_calls."""
    return chat_server


def chat(server, **fields):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": 5,
        **fields,
    }
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def test_json_schema_output_parses_and_validates(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    choices = chat(server, response_format=fmt, n=3)
    assert len(choices) == 3
    for c in choices:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)


def test_json_object_output_is_an_object(server):
    # An open-ended object may nest until max_tokens (finish "length", as with OpenAI); this prompt
    # and seed give objects that close.
    ask = [{"role": "user", "content": "Give me a person as JSON with name and age."}]
    for c in chat(
        server, messages=ask, response_format={"type": "json_object"}, temperature=0.7, seed=3, n=2
    ):
        assert c["finish_reason"] == "stop", c
        assert isinstance(json.loads(c["message"]["content"]), dict)


def test_guided_fields_on_completions(server):
    def complete(**fields):
        body = {
            "model": MODEL,
            "prompt": "My phone number is",
            "max_tokens": 20,
            "temperature": 1.0,
            "seed": 1,
        }
        r = server.post("/v1/completions", json={**body, **fields})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", complete(guided_regex=r"[0-9]{3}-[0-9]{4}"))
    assert complete(guided_choice=["red", "green", "blue"]) in {"red", "green", "blue"}
    assert complete(structured_outputs={"choice": ["yes", "no"]}) in {"yes", "no"}
    assert complete(guided_grammar='start: "x" ("ab" | "cd") "y"') in {"xaby", "xcdy"}


def test_structured_output_streams(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "A person, please."}],
        "max_tokens": 120,
        "stream": True,
        "response_format": fmt,
    }
    text, finish = "", None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch:
                    text += ch[0]["delta"].get("content") or ""
                    finish = ch[0]["finish_reason"] or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


SCHEMAS = {
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "status": {"enum": ["open", "shipped", "closed"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "status", "items"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "celsius": {"type": "number", "minimum": -60, "maximum": 60},
            "sky": {"enum": ["clear", "cloudy", "rain", "snow"]},
            "wind": {
                "type": "object",
                "properties": {
                    "kmh": {"type": "integer", "minimum": 0, "maximum": 200},
                    "dir": {"enum": ["N", "E", "S", "W"]},
                },
                "required": ["kmh", "dir"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "celsius", "sky", "wind"],
        "additionalProperties": False,
    },
}
PROMPTS = ["Make one up.", "Answer in JSON.", "Give an example for a shop in Paris.", "Quick, one please!"]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_openai_sdk_gets_valid_json_schema_answers_on_many_prompts(server, name):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    for i, prompt in enumerate(PROMPTS):
        resp = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{prompt} ({name})"}],
            response_format=fmt,
            max_tokens=200,
            temperature=0.8,
            seed=i,
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_logit_bias_moves_the_output_as_asked_through_the_sdk(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    args = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**args, extra_body={"return_token_ids": True})
    first = plain.choices[0].token_ids[0]
    # -100 bans the greedy first token; +100 on another token makes it the only choice.
    banned = client.completions.create(
        **args, logit_bias={str(first): -100}, extra_body={"return_token_ids": True}
    )
    assert banned.choices[0].token_ids[0] != first
    forced = client.completions.create(
        **args, logit_bias={"1234": 100}, extra_body={"return_token_ids": True}
    )
    assert forced.choices[0].token_ids == [1234] * 4


def test_a_resumed_request_grammar_picks_up_after_its_tokens():
    """A gateway's resume hands the replica the tokens already streamed: the matcher consumes them,
    and tokens the grammar cannot have produced are refused, not silently ignored."""
    from shoal.engine.sampling_params import InvalidParamError
    from shoal.engine.structured import GrammarBackend, StructuredOutput, unpack_bitmask
    from shoal.models.loader import load_tokenizer

    tok = load_tokenizer()
    eos = sorted(tok.eos_token_ids)
    backend = GrammarBackend(tok.backend, tok.backend.get_vocab_size(), eos)
    choice = StructuredOutput("choice", json.dumps(["yes please", "no thanks"]), "guided_choice")
    done = tok.backend.encode("yes please", add_special_tokens=False).ids
    m = backend.matcher(choice, done)
    allowed_ids = unpack_bitmask(backend.fill(m)).nonzero().flatten().tolist()
    assert set(allowed_ids) <= set(eos) and allowed_ids  # the answer is complete: only EOS is left
    with pytest.raises(InvalidParamError):
        backend.matcher(choice, tok.backend.encode("maybe", add_special_tokens=False).ids)


def _outside_strings(text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def test_json_has_no_whitespace_between_tokens_unless_asked(server):
    """By default JSON comes out as OpenAI's strict mode writes it, with no whitespace outside
    strings; vLLM's guided_whitespace_pattern (or structured_outputs.whitespace_pattern) opts in."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    ask = [{"role": "user", "content": "Describe a person as JSON, nicely indented."}]
    compact = chat(server, messages=ask, response_format=fmt, n=2, temperature=0.7)
    for c in compact:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
    compact += chat(server, messages=ask, response_format={"type": "json_object"}, max_tokens=40)
    for c in compact:
        assert not re.search(r"\s", _outside_strings(c["message"]["content"])), c
    spaced = chat(
        server, messages=ask, response_format=fmt, n=2, max_tokens=60, guided_whitespace_pattern="[ \n]+"
    )
    spaced += chat(server, messages=ask, guided_json=PERSON, structured_outputs={"whitespace_pattern": "[ ]"})
    assert any(re.search(r"\s", _outside_strings(c["message"]["content"])) for c in spaced)
    for c in spaced:
        assert not re.search(r"[\t\r]", _outside_strings(c["message"]["content"]))  # only what was allowed
        if c["finish_reason"] == "stop":
            jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
    r = server.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ask, "guided_regex": "[a-z]+", "guided_whitespace_pattern": " "},
    )
    assert r.status_code == 400 and "JSON output only" in r.text


def test_a_json_grammar_admits_whitespace_only_as_asked():
    """The grammar itself, token by token: compact JSON that fits the schema passes, whitespace
    between tokens does not (unless the pattern allows it), and the schema still binds."""
    from shoal.engine.structured import FREE_WHITESPACE, GrammarBackend, StructuredOutput
    from shoal.models.loader import load_tokenizer

    tok = load_tokenizer()
    backend = GrammarBackend(tok.backend, tok.backend.get_vocab_size(), sorted(tok.eos_token_ids))

    def accepts(structured: StructuredOutput, text: str) -> bool:
        m = backend.matcher(structured, [])
        ids = tok.backend.encode(text, add_special_tokens=False).ids
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    compact = '{"name":"Al Bo","age":30,"tags":["a","c"]}'
    spaced = '{\n  "name": "Al Bo",\n  "age": 30,\n  "tags": ["a", "c"]\n}'
    for kind, spec in (("json_schema", json.dumps(PERSON)), ("json_object", "")):
        assert accepts(StructuredOutput(kind, spec), compact)
        assert not accepts(StructuredOutput(kind, spec), spaced)
        assert accepts(StructuredOutput(kind, spec, whitespace=FREE_WHITESPACE), spaced)
        assert not accepts(StructuredOutput(kind, spec, whitespace="[ ]"), spaced)  # no newlines
    strict = StructuredOutput("json_schema", json.dumps(PERSON))
    assert not accepts(strict, '{"name":"Al","age":"30","tags":[]}')  # age must be an integer
    assert not accepts(strict, '{"name":"Al","tags":[]}')  # age is required
    flexible = StructuredOutput("json_schema", json.dumps(PERSON), whitespace=FREE_WHITESPACE)
    assert not accepts(flexible, '{"name": "Al", "tags": ["d"]}')
