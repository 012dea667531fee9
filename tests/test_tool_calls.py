"""Tool calls as OpenAI clients make them: offered tools reach the prompt in the chat template's
format, required and named calls are grammar-constrained so they always parse and validate,
streamed calls reassemble to the non-streamed answer, and a tool result goes back to the model.
On the bundled SmolLM2 (its own format, rendered by shoal) and on random checkpoints whose chat
templates write Hermes / Qwen and Llama 3 style calls."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest

from shoal.engine.structured import GrammarBackend, StructuredOutput
from shoal.models.tool_formats import FORMATS, HERMES, LLAMA3_JSON, SMOLLM2
from shoal.server.tool_parser import ToolCallParser
from tests.server_helpers import start_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 60}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "search_web", "description": "Search the web", "parameters": SEARCH},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What is the weather in Paris?",
    "Is it raining in Tokyo right now?",
    "Find me recent news about electric cars.",
    "Should I take an umbrella in London today?",
]


# --- the parser: what it reads does not depend on how the text was cut -------------------------

PARSER_CASES = [
    (
        SMOLLM2,
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "n": [1, {"a": "}"}]}},'
        ' {"name": "f2", "arguments": {}}]</tool_call>',
        "",
        [("get_weather", '{"city": "Paris, \\"FR\\"", "n": [1, {"a": "}"}]}'), ("f2", "{}")],
    ),
    (SMOLLM2, "Hello there, <tool no call here", "Hello there, <tool no call here", []),
    (
        SMOLLM2,
        'Let me check.\n<tool_call>[{"name": "x", "arguments": {"q": 1}}]</tool_call>\n',
        "Let me check.",
        [("x", '{"q": 1}')],
    ),
    (SMOLLM2, '<tool_call>[{"nam": 3}]</tool_call> rest', '<tool_call>[{"nam": 3}]</tool_call> rest', []),
    (SMOLLM2, '<tool_call>[{"name": "cut", "arguments": {"city": "Par', "", [("cut", '{"city": "Par')]),
    (SMOLLM2, '<tool_call>[{"name": "bare"}]</tool_call>', "", [("bare", "{}")]),
    (
        HERMES,
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"y": "z"}}\n</tool_call>',
        "",
        [("a", '{"x": 1}'), ("b", '{"y": "z"}')],
    ),
    (HERMES, "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (
        LLAMA3_JSON,
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": 2}}',
        "",
        [("a", '{"x": 1}'), ("b", '{"y": 2}')],
    ),
    (LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),
    (LLAMA3_JSON, "Plain text answer.", "Plain text answer.", []),
]


def parse(fmt, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)], ids) from feeding `pieces` one at a time."""
    parser = ToolCallParser(fmt)
    content, calls = "", {}
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        for c in delta.calls:
            first = c.index not in calls  # id and name come once, in a call's first delta
            assert (c.id is not None) == first and (c.name is not None) == first
            entry = calls.setdefault(c.index, {"id": c.id, "name": c.name, "arguments": ""})
            entry["arguments"] += c.arguments
    merged = [calls[i] for i in sorted(calls)]
    assert [(c["name"], c["arguments"]) for c in merged] == [(c.name, c.arguments) for c in parser.calls]
    return content, [(c["name"], c["arguments"]) for c in merged], [c["id"] for c in merged]


@pytest.mark.parametrize("fmt, text, content, calls", PARSER_CASES)
def test_parser_reads_each_format_however_the_text_is_cut(fmt, text, content, calls):
    whole = parse(fmt, [text])
    assert whole[:2] == (content, calls)
    assert all(i.startswith("call_") and len(i) == 29 for i in whole[2])
    rng = random.Random(len(text))
    for _ in range(100):
        cuts, i = [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            cuts.append(text[i : i + k])
            i += k
        assert parse(fmt, cuts)[:2] == whole[:2]


@pytest.fixture(scope="module")
def grammars(bundled):
    tok = bundled.tokenizer
    return tok, GrammarBackend(tok.backend, bundled.config.vocab_size, [tok.eos_token_id])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_tool_grammar_admits_calls_of_the_offered_tools_only(grammars, fmt):
    tok, backend = grammars
    fmt = FORMATS[fmt]
    tools = [t["function"] for t in TOOLS]
    one = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    two = [*one, {"name": "search_web", "arguments": '{"query": "news"}'}]

    def accepts(calls, parallel: bool, text: str | None = None) -> bool:
        m = backend.matcher(StructuredOutput("grammar", fmt.grammar(tools, parallel), "tools"), [])
        ids = tok.encode(text if text is not None else fmt.call_text(calls), add_special_tokens=False)
        return m.consume_tokens(ids) and not m.is_error() and m.is_accepting()

    assert accepts(one, parallel=False)
    assert accepts(two, parallel=True)
    assert not accepts(two, parallel=False)
    assert not accepts([{"name": "delete_everything", "arguments": "{}"}], parallel=True)
    assert not accepts([{"name": "get_weather", "arguments": '{"town": "Paris"}'}], parallel=True)
    assert not accepts(None, parallel=True, text="Sure, here is the weather.")


# --- the bundled model, through a real server --------------------------------------------------


@pytest.fixture(scope="module")
def server(chat_server):
    """The bundled model's server (see conftest), shared with test_structured_output."""
    return chat_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_calls(message, allowed: set[str]) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


@pytest.mark.parametrize("choice", ["required", "get_weather", "search_web"])
def test_required_and_named_calls_always_parse_and_validate(client, choice):
    named = choice != "required"
    tool_choice = {"type": "function", "function": {"name": choice}} if named else "required"
    for prompt in PROMPTS:
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice=tool_choice,
            temperature=0.8,
            seed=3,
            max_tokens=120,
        )
        c = out.choices[0]
        assert c.finish_reason == "tool_calls", c
        calls = check_calls(c.message, {choice} if named else set(SCHEMAS))
        assert c.message.content is None
        assert out.usage.completion_tokens > 5
        if named:
            assert all(call.function.name == choice for call in calls)


def test_streamed_tool_calls_reassemble_to_the_non_streamed_answer(client):
    for prompt, parallel in [(PROMPTS[0], False), (PROMPTS[2], True), ("Weather in Oslo and Rome?", True)]:
        args = dict(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            temperature=0,
            max_tokens=120,
        )
        whole = client.chat.completions.create(**args).choices[0]
        calls: dict[int, dict] = {}
        finish = None
        pieces = 0
        for chunk in client.chat.completions.create(**args, stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            assert not delta.content
            for tc in delta.tool_calls or []:
                first = tc.index not in calls  # id and name come once, in a call's first delta
                assert (tc.id is not None) == first and (tc.function.name is not None) == first
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                entry["arguments"] += tc.function.arguments or ""
                pieces += 1
            finish = chunk.choices[0].finish_reason or finish
        assert finish == whole.finish_reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (t.function.name, t.function.arguments) for t in whole.message.tool_calls
        ]
        assert all(c["id"].startswith("call_") for c in calls.values())
        assert pieces > len(calls) + 2  # the arguments came in pieces, not at the end
        check_calls(whole.message, set(SCHEMAS))


def test_a_tool_result_goes_back_to_the_model(client, server):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=question, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80
    )
    call = check_calls(first.choices[0].message, set(SCHEMAS))[0]
    assert call.function.name == "get_weather"
    result = json.dumps({"city": json.loads(call.function.arguments)["city"], "sky": "sunny", "temp_c": 18})
    history = [
        *question,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    # The final turn asks for the answer, as an agent does once it has its results.
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=60
    ).choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert "sunny" in final.message.content.lower()
    # The call and its result reached the prompt in SmolLM2's format.
    ids = server.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    prompt = server.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "<tools>" in prompt and '"name": "search_web"' in prompt
    assert (
        f'<tool_call>[{{"name": "get_weather", "arguments": {call.function.arguments}}}]</tool_call>'
        in prompt
    )
    assert f"<|im_start|>tool\n{result}<|im_end|>" in prompt


def test_tool_choice_none_and_auto_answer_in_text(client):
    for choice in ("none", "auto"):
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello to Ada."}],
            tools=TOOLS,
            tool_choice=choice,
            temperature=0,
            max_tokens=30,
        ).choices[0]
        assert out.message.content and not out.message.tool_calls
        assert out.finish_reason in ("stop", "length")


def test_a_resumed_tool_call_stream_goes_on_where_it_stopped(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[2]}],
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 80,
        "stream": True,
        "return_token_ids": True,
    }

    def stream(b) -> list[dict]:
        chunks = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=b, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    obj = json.loads(line[6:])
                    if obj["choices"]:
                        chunks.append(obj)
        return chunks

    def assemble(chunks) -> list[tuple[str, str]]:
        calls: dict[int, list] = {}
        for ch in chunks:
            for tc in ch["choices"][0]["delta"].get("tool_calls", []):
                entry = calls.setdefault(tc["index"], [tc["function"].get("name"), ""])
                entry[1] += tc["function"].get("arguments", "")
        return [tuple(calls[i]) for i in sorted(calls)]

    full = stream(body)
    prompt_ids = full[0]["prompt_token_ids"]
    for cut in (3, len(full) // 2, len(full) - 2):
        head = full[:cut]
        output_ids = [t for ch in head for t in ch["choices"][0].get("token_ids", [])]
        resume = {
            "prompt_token_ids": prompt_ids,
            "output_token_ids": output_ids,
            "index": 0,
            "text_offset": 0,
        }
        tail = stream({**body, "resume": resume})
        assert assemble(head + tail) == assemble(full)
        assert tail[-1]["choices"][0]["finish_reason"] == "tool_calls"


# --- other chat templates' formats, on random checkpoints --------------------------------------

# Written for these tests in the shape of the Hermes / Qwen 2.5 and Llama 3.1 templates.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Functions you may call, one JSON object each:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Call one as <tool_call>
{"name": NAME, "arguments": ARGS}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>

Answer a call as JSON, {"name": NAME, "parameters": ARGS}. Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>

{% if m.tool_calls %}{% for c in m.tool_calls %}<|python_tag|>{"name": "{{ c.function.name }}", \
"parameters": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>\
{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Values from short enums and small ranges only: a random model's strings would run on.
BOUNDED = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
BOUNDED_TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": BOUNDED}},
    {
        "type": "function",
        "function": {
            "name": "alarm",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


@pytest.fixture(
    scope="module", params=[("qwen2", HERMES_TEMPLATE, "hermes"), ("llama", LLAMA3_TEMPLATE, "llama3_json")]
)
def random_server(request, tmp_path_factory):
    from tests.test_hf_parity import make_random_checkpoint

    arch, template, fmt = request.param
    path = tmp_path_factory.mktemp(f"tools-{arch}")
    make_random_checkpoint(
        arch, path, max_position_embeddings=2048
    )  # its tokenizer is tiny: prompts are long
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    s = start_server(str(path), "--max-model-len", "2048", "--num-blocks", "160")
    yield s, fmt
    s.stop()


def test_other_templates_render_and_parse_their_own_format(random_server):
    server, fmt = random_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    history = [
        {"role": "user", "content": "Forecast for Lima?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "forecast", "arguments": '{"city": "Lima", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "cloudy"},
        {"role": "user", "content": "And Tokyo?"},
    ]
    ids = server.post("/tokenize", json={"messages": history, "tools": BOUNDED_TOOLS}).json()["tokens"]
    prompt = server.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '{"name": "alarm", "parameters"' in prompt  # the template listed the tools itself
    if fmt == "hermes":
        assert (
            '<tool_call>\n{"name": "forecast", "arguments": {"city": "Lima", "days": 2}}\n</tool_call>'
            in prompt
        )
        assert "<tool_response>\ncloudy\n</tool_response>" in prompt
    else:
        assert '<|python_tag|>{"name": "forecast", "parameters": {"city": "Lima", "days": 2}}' in prompt
        assert "<|start_header_id|>ipython<|end_header_id|>\n\ncloudy" in prompt
    for seed, choice in enumerate(["required", "required", "forecast", "alarm"]):
        named = choice != "required"
        args = dict(
            model=model,
            messages=history,
            tools=BOUNDED_TOOLS,
            tool_choice={"type": "function", "function": {"name": choice}} if named else "required",
            parallel_tool_calls=False,  # a random model would add calls until max_tokens
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        whole = client.chat.completions.create(**args).choices[0]
        assert whole.finish_reason == "tool_calls", whole
        for call in whole.message.tool_calls:
            assert call.function.name == choice if named else call.function.name in ("forecast", "alarm")
            spec = next(t["function"] for t in BOUNDED_TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
        streamed: dict[int, list] = {}
        for chunk in client.chat.completions.create(**args, stream=True):
            for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                streamed.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
        assert [tuple(v) for v in streamed.values()] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls
        ]
