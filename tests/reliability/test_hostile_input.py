"""Hostile input against a live server: generated from openapi.yaml by schemathesis, then targeted cases.
Every answer is a 2xx that fits the schema or a 4xx with the route's error body (OpenAI's, or Anthropic's on
/v1/messages), never a 5xx or a leak."""

import json
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server.api.anthropic import protocol as mp
from server.api.openai import protocol as p
from server.api.openai import responses_protocol as rp
from tests.helpers.live_server import (
    MODEL_NAME,
    Server,
    assert_anthropic_error,
    assert_no_leak,
    assert_openai_error,
    named_sse_payloads,
    sse_payloads,
    start_server,
)

pytestmark = pytest.mark.slow

OPENAPI = Path(__file__).resolve().parents[2] / "openapi.yaml"
schema = schemathesis.openapi.from_path(OPENAPI)


@pytest.fixture(scope="module")
def hostile_server(tiny_llama_dir, tmp_path_factory):
    server = start_server(
        tiny_llama_dir, tmp_path_factory.mktemp("hostile") / "server.log", "--max-model-len", "128"
    )
    yield server
    server.stop()


def openai_shaped_errors(ctx, response, case) -> None:
    """Errors in the route's shape: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    assert_no_leak(response.text)
    if response.status_code >= 400:
        body = json.loads(response.text)
        if case.path.startswith("/v1/messages"):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, response.text
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}, response.text
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], response.text


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    openai_shaped_errors,
]


@pytest.mark.timeout(300)
@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_generated_requests(case, hostile_server: Server):
    response = case.call(base_url=hostile_server.url, timeout=60)
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return case.validate_response(response, checks=CHECKS)
    # schemathesis reads an SSE schema as the envelope of each event (OpenAPI 3.2); ours describes the JSON
    # payload of each `data:` line, so streams are checked here: framing, then each payload's shape.
    case.validate_response(response, checks=[c for c in CHECKS if c is not response_schema_conformance])
    named = {"/v1/responses": rp.ResponseStreamEvent, "/v1/messages": mp.MessageStreamEvent}
    if case.path in named:
        for payload in named_sse_payloads(response.content):
            named[case.path].model_validate(payload)
        return
    for payload in sse_payloads(response.content):
        if "error" in payload:
            assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
        else:
            chunk = p.ChatCompletionStreamResponse if "chat" in case.path else p.CompletionStreamResponse
            chunk.model_validate(payload)


COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def post_raw(url: str, route: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}{route}", content=body, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.timeout(120)
def test_targeted_cases_are_clear_4xx(hostile_server: Server):
    url = hostile_server.url
    cases = [
        ("/v1/completions", {**COMPLETION, "max_tokens": 10**12}, None),  # names the context it exceeds
        ("/v1/completions", {**COMPLETION, "max_tokens": 10**30}, None),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, None),
        ("/v1/completions", {**COMPLETION, "n": 10**6}, "n"),
        ("/v1/chat/completions", {**CHAT, "n": 17}, "n"),
        ("/v1/completions", {**COMPLETION, "logprobs": 10**6}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
        ("/v1/completions", {**COMPLETION, "temperature": -0.5}, "temperature"),
        ("/v1/completions", {**COMPLETION, "top_p": -0.01}, "top_p"),  # 0 is valid (OpenAI takes it): top-1
        ("/v1/completions", {**COMPLETION, "top_p": 1.0001}, "top_p"),
        ("/v1/completions", {**COMPLETION, "top_p": -1}, "top_p"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 300]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2, -1]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [[5], [1, 10**12]]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": []}, None),
        ("/v1/completions", {**COMPLETION, "prompt": ""}, None),
        ("/v1/completions", {**COMPLETION, "stop": [f"s{i}" for i in range(5000)]}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": ["x"] * 5000}, "stop"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, None),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "hi"}]}, None),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "hi"}]}, None),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
        ("/detokenize", {"tokens": [10**12]}, "tokens"),
    ]
    for route, body, param in cases:
        error = assert_openai_error(httpx.post(f"{url}{route}", json=body, timeout=60), 400)
        assert param is None or (error["param"] or "").startswith(param), (body, error)
    # JSON literals Python's json accepts but no number should be: NaN and Infinity
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"):
        for literal in ("NaN", "Infinity", "-Infinity"):
            raw = f'{{"model": "{MODEL_NAME}", "prompt": "hi", "max_tokens": 2, "{field}": {literal}}}'
            r = post_raw(url, "/v1/completions", raw.encode())
            assert_openai_error(r, 400)
    assert httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=60).status_code == 200


RESPONSE = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4}
MESSAGE = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.timeout(180)
def test_targeted_cases_on_responses_and_messages(hostile_server: Server):
    url = hostile_server.url
    deep = _nested_schema(80)
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    refused = [
        ({**RESPONSE, "max_output_tokens": 10**12}, "input"),
        ({**RESPONSE, "input": []}, "input"),
        ({**RESPONSE, "input": 5}, "input"),
        ({**RESPONSE, "input": [{"role": "wizard", "content": "hi"}]}, "input"),
        ({**RESPONSE, "input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({**RESPONSE, "tools": [tool] * 129}, "tools"),
        ({**RESPONSE, "tools": [{**tool, "parameters": deep}]}, "tools"),
        ({**RESPONSE, "tools": [{"type": "telepathy", "server_label": "x"}]}, "tools"),
        ({**RESPONSE, "tool_choice": {"type": "mcp", "server_label": "x"}}, "tool_choice"),
        (
            {**RESPONSE, "tool_choice": {"type": "function", "name": "g" * 10_000}, "tools": [tool]},
            "tool_choice",
        ),
        ({**RESPONSE, "text": {"format": {"type": "json_schema", "name": "x", "schema": deep}}}, "text"),
        (
            {
                **RESPONSE,
                "text": {
                    "format": {"type": "json_schema", "schema": {"type": "string", "pattern": "(?=a)b"}}
                },
            },
            "text.format",
        ),
        ({**RESPONSE, "temperature": -1}, "temperature"),
        ({**RESPONSE, "background": True}, "background"),
        ({**RESPONSE, "conversation": "conv_1"}, "conversation"),
    ]
    for body, param in refused:
        error = assert_openai_error(httpx.post(f"{url}/v1/responses", json=body, timeout=60), 400)
        assert (error["param"] or "").startswith(param), (str(body)[:200], error)
    lone = b'{"input": [{"role": "user", "content": "a\\ud800"}]}'  # a lone surrogate escape: no text at all
    assert assert_openai_error(post_raw(url, "/v1/responses", lone), 400)["param"].startswith("input")
    # a call in the history with broken arguments is rendered as written
    broken = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}
    r = httpx.post(f"{url}/v1/responses", json={**RESPONSE, "input": [broken]}, timeout=60)
    assert r.status_code == 200, r.text
    use = {"type": "tool_use", "id": "t", "name": "f", "input": deep}
    messages = [
        {**MESSAGE, "max_tokens": 10**12},  # more than the context: what fits is generated
        {**MESSAGE, "messages": [{"role": "user", "content": [use]}]},
        {**MESSAGE, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        {**MESSAGE, "messages": [{"role": "user", "content": 5}]},
        {**MESSAGE, "messages": [{"role": "developer", "content": "hi"}]},
        {**MESSAGE, "messages": [{"role": "system", "content": [{**use, "input": {}}]}]},
        {**MESSAGE, "system": [{"type": "text"}]},
        {**MESSAGE, "tools": [{"name": "f", "input_schema": deep}]},
        {**MESSAGE, "tools": [{"name": "f", "input_schema": {"type": "object"}}] * 129},
        {**MESSAGE, "tools": [{"type": "bash_20250124", "name": "bash"}]},
        {**MESSAGE, "tool_choice": {"type": "any"}},  # no tools
        {**MESSAGE, "stop_sequences": [""]},
        {**MESSAGE, "top_k": -5},
        {**MESSAGE, "output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
    ]
    for body in messages:
        r = httpx.post(f"{url}/v1/messages", json=body, timeout=60)
        if body["max_tokens"] == 10**12:
            assert r.status_code == 200, r.text
            continue
        assert assert_anthropic_error(r, 400)["type"] == "invalid_request_error", str(body)[:200]
    assert httpx.post(f"{url}/v1/responses", json=RESPONSE, timeout=60).status_code == 200
    assert httpx.post(f"{url}/v1/messages", json=MESSAGE, timeout=60).status_code == 200
    assert "Traceback" not in hostile_server.log()


@pytest.mark.timeout(120)
def test_huge_nested_and_broken_bodies(hostile_server: Server):
    url = hostile_server.url
    big = json.dumps({**COMPLETION, "prompt": "x" * (10 << 20)}).encode()
    assert_openai_error(post_raw(url, "/v1/completions", big), 413)
    for depth in (1000, 100_000):
        nested = b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 2}'
        assert_openai_error(post_raw(url, "/v1/completions", nested), 400)
        deep_object = b'{"a": ' * depth + b"1" + b"}" * depth
        assert_openai_error(post_raw(url, "/v1/chat/completions", deep_object), 400)
    for body in [b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}', b"\xc3\x28", b'{"prompt": "\xed\xa0\x80"}']:
        assert_openai_error(post_raw(url, "/v1/completions", body), 400)
        assert_openai_error(post_raw(url, "/v1/responses", body), 400)
        assert_anthropic_error(post_raw(url, "/v1/messages", body), 400)
    for depth in (1000, 100_000):
        nested = b'{"input": ' + b"[" * depth + b"]" * depth + b"}"
        assert_openai_error(post_raw(url, "/v1/responses", nested), 400)
        deep_object = b'{"a": ' * depth + b"1" + b"}" * depth
        assert_anthropic_error(post_raw(url, "/v1/messages", deep_object), 400)
    huge = json.dumps({**MESSAGE, "system": "x" * (10 << 20)}).encode()
    assert_anthropic_error(post_raw(url, "/v1/messages", huge), 413)
    # a lone surrogate escape is valid JSON; it must not break tokenizing or the answer
    r = post_raw(url, "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}')
    assert r.status_code == 200 or assert_openai_error(r, 400)
    # the server is still there and well
    r = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert "Traceback" not in hostile_server.log()


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.timeout(180)
def test_hostile_grammars_and_tools(hostile_server: Server):
    """Schemas, regexes, grammars and tools built to hurt: a 400 naming the field, or an answer; never a 500,
    a hang, or a server that stops answering others."""
    url = hostile_server.url

    def fmt(schema) -> dict:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    deep_arguments = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    deep_arguments["tool_calls"][0]["function"]["arguments"] = _nested_schema(80)
    refused = [
        (fmt(_nested_schema(70)), "response_format"),  # deeper than the API takes
        (fmt(_nested_schema(500)), "response_format"),
        (fmt({"enum": [f"v{i}" for i in range(100_000)]}), "response_format"),  # a grammar too big
        (fmt({"type": "integer", "minimum": 10, "maximum": 1}), "response_format"),  # unsatisfiable
        (fmt({"type": "string", "pattern": "(?=a)b"}), "response_format"),  # lookahead
        ({"structured_outputs": {"regex": "(" * 5000 + ")" * 5000}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{" * 3000}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: " + '"a" ' * 100_000}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        (fmt({"$ref": "#"}), "response_format"),  # recursive without a base: no text matches it
        ({"tools": [tool] * 129}, "tools"),
        ({"tools": [{**tool, "function": {"name": "f", "parameters": _nested_schema(100)}}]}, "tools"),
        (
            {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g" * 10_000}}},
            "tool_choice",
        ),
        ({"messages": [{"role": "user", "content": "hi"}, deep_arguments]}, "messages"),
    ]
    for extra, param in refused:
        error = assert_openai_error(
            httpx.post(f"{url}/v1/chat/completions", json={**CHAT, **extra}, timeout=60), 400
        )
        assert (error["param"] or "").startswith(param), (str(extra)[:200], error)
    answered = [
        fmt({"type": "array", "minItems": 10**9}),  # cut by max_tokens
        {"structured_outputs": {"regex": "a{100000}"}},
        {"structured_outputs": {"regex": "(a*)*b"}, "stream": True},
    ]
    for extra in answered:
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, **extra}, timeout=60)
        assert r.status_code == 200, (str(extra)[:200], r.text[:300])
    r = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
    assert "Traceback" not in hostile_server.log()
