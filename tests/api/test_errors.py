"""Errors with OpenAI's body shape, limits, loading and draining, and request plumbing (ids, CORS, log lines)."""

import asyncio
import json
import logging

import httpx
import llguidance
import pytest

from server.api import fleet, routes, ui
from server.api.anthropic import routes as anthropic_routes
from server.api.app import begin_drain, drain, set_engine
from server.api.openai import routes as openai_routes
from server.engine.async_engine import AsyncEngine
from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.grammar import GrammarCompiler

pytestmark = pytest.mark.timeout(60)

PROMPT = {"prompt": "hello there", "max_tokens": 4, "temperature": 0}


def assert_error(r: httpx.Response, status: int, param: str | None = ..., contains: str = "") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and 0 < len(error["message"]) <= 300
    assert param is ... or error["param"] == param
    assert contains in error["message"]
    assert "Traceback" not in r.text and "/server/" not in r.text and ".py" not in r.text
    return error


LONG = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}


def test_bad_requests_are_400_naming_the_field(tiny_engine, start_server):
    url, _ = start_server(tiny_engine)
    post = httpx.Client(base_url=url).post
    cases = [
        ({**PROMPT, "temperature": -1}, "temperature"),
        ({**PROMPT, "n": 17}, "n"),
        ({**PROMPT, "logprobs": 6}, "logprobs"),
        ({**PROMPT, "stop": ["x"] * 17}, "stop"),
        ({**PROMPT, "prompt": 12}, "prompt"),
        ({**PROMPT, "prompt": [[1, 2], "a"]}, "prompt"),
        ({**PROMPT, "max_tokens": 0}, "max_tokens"),
        ({**PROMPT, "suffix": "x"}, "suffix"),
        ({**PROMPT, "best_of": 2}, "best_of"),
        ({**PROMPT, "best_of": 1, "n": 2}, "best_of"),  # fewer candidates than choices (OpenAI's 400 too)
        ({**PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),  # not streaming
        ({**PROMPT, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**PROMPT, "logit_bias": {"10000000": 5}}, "logit_bias"),  # beyond the vocabulary
        ({**PROMPT, "logit_bias": {"-1": 5}}, "logit_bias"),
        ({**PROMPT, "logit_bias": {"1": 101}}, "logit_bias"),
        ({**PROMPT, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"max_tokens": 3}, "prompt"),
    ]
    for body, param in cases:
        assert_error(post("/v1/completions", json=body), 400, param)
    for bias in ({"x": 1}, {"1": "much"}, [1, 2]):
        r = post("/v1/completions", json={**PROMPT, "logit_bias": bias})
        assert_error(r, 400)
        assert r.json()["error"]["param"].startswith("logit_bias")
    nan = b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"1": NaN}}'
    assert_error(post("/v1/completions", content=nan, headers={"content-type": "application/json"}), 400)
    for field in ("temperature", "top_p", "presence_penalty"):  # said as what they are, not as out of range
        for value in (b"NaN", b"Infinity", b"-Infinity"):
            body = b'{"prompt": "hi", "max_tokens": 2, "%s": %s}' % (field.encode(), value)
            r = post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert_error(r, 400, field, "finite")
    assert_error(post("/v1/completions", json={**PROMPT, "seed": 2**63}), 400, "seed", "signed 64-bit")
    assert post("/v1/completions", json={**PROMPT, "seed": 2**63 - 1}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field, value in [
        ("tools", [{"type": "web_search"}]),  # only functions
        ("tools", [{"type": "function", "function": {"name": "no spaces"}}]),
        ("tool_choice", "required"),  # with no tools
        ("tool_choice", "sometimes"),
        ("response_format", {"type": "xml"}),
        ("response_format", {"type": "json_schema"}),  # no schema
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        ),
        ("structured_outputs", {"regex": "(unclosed"}),
        ("structured_outputs", {"regex": "a", "choice": ["b"]}),  # one at a time
        ("structured_outputs", {"grammar": "root ::= missing_rule"}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("top_logprobs", 21),
        ("messages", [{"role": "function", "content": "x"}]),
        ("messages", [{"role": "assistant"}]),  # neither content nor tool_calls
        ("messages", [{"role": "assistant", "tool_calls": [{"type": "function"}]}]),
        ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        ("messages", []),
    ]:
        r = post("/v1/chat/completions", json={**chat, field: value})
        assert_error(r, 400)
        assert r.json()["error"]["param"].startswith(field)
    # allowed neutral values of the unsupported fields, and unknown fields, pass
    neutral = {
        **chat,
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "tools": None,
        "whatever": 1,
    }
    assert post("/v1/chat/completions", json=neutral).status_code == 200
    # an OpenAI reply's refusal sent back in the history, as a field or a part: its text
    for refused in (
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
    ):
        history = [{"role": "user", "content": "hi"}, refused, {"role": "user", "content": "ok"}]
        r = post("/v1/chat/completions", json={**chat, "messages": history})
        assert r.status_code == 200, r.text
        prompt = post("/tokenize", json={"messages": history}).json()["tokens"]
        as_text = [*history[:1], {"role": "assistant", "content": "I can't help with that."}, history[2]]
        assert prompt == post("/tokenize", json={"messages": as_text}).json()["tokens"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "g"}}
    assert_error(
        post("/v1/chat/completions", json={**chat, "tools": tools, "tool_choice": named}), 400, "tool_choice"
    )
    assert_error(post("/v1/chat/completions", json={**chat, "tools": tools + tools}), 400, "tools")
    r = post("/v1/chat/completions", json={**chat, "tool_choice": "required"})
    assert_error(r, 400, "tool_choice", "asks for a tool call, but the request has no tools")
    # a tool whose parameters are no schema, whatever tool_choice says (as OpenAI's), and on every route
    for parameters, why in (({"type": "nope"}, "nope"), ({"properties": {"a": {"$ref": "#/$defs/x"}}}, "x")):
        bad_schema = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
        for choice in ({"tool_choice": "required"}, {"tool_choice": "auto"}, {"tool_choice": "none"}, {}):
            r = post("/v1/chat/completions", json={**chat, "tools": bad_schema, **choice})
            assert_error(r, 400, "tools", why)
        messages = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        tool = {"name": "f", "input_schema": parameters}
        r = post("/v1/messages", json={**messages, "tools": [tool]})
        assert_anthropic_error(r, 400, "invalid_request_error", why)
        tool = {"type": "function", "name": "f", "parameters": parameters}
        r = post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "tools": [tool]})
        assert_error(r, 400, "tools", why)
    # each tool checked as its own strict says: a keyword no grammar holds only refuses a strict tool
    unique = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    closed = {"type": "object", "properties": {}, "additionalProperties": False}
    for strict, status in ((False, 200), (True, 400)):
        mixed = [
            {"type": "function", "function": {"name": "s", "strict": True, "parameters": closed}},
            {"type": "function", "function": {"name": "u", "strict": strict, "parameters": unique}},
        ]
        # none: tools out of the prompt, which this context could not hold, and still checked
        r = post("/v1/chat/completions", json={**chat, "tools": mixed, "tool_choice": "none"})
        assert r.status_code == status, r.text
    assert_error(r, 400, "tools", "u's parameters: ")
    both = {**chat, "tools": tools, "structured_outputs": {"choice": ["a"]}}
    assert_error(post("/v1/chat/completions", json=both), 400, "structured_outputs")
    assert (
        post("/v1/completions", json={**PROMPT, "best_of": 1, "logit_bias": {}, "x-extra": [1]}).status_code
        == 200
    )
    # the whole body
    assert_error(post("/v1/completions", content=b"{bad", headers={"content-type": "application/json"}), 400)
    assert_error(
        post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400
    )
    # a field's path, never pydantic's words for the union member or validator it tried
    for body, param in [
        ({**chat, "stop": [5]}, "stop"),
        ({**chat, "tool_choice": "bogus"}, "tool_choice"),
        ({**chat, "structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ]:
        assert_error(post("/v1/chat/completions", json=body), 400, param, f"{param}: ")
    messages = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    # a schema's keyword no grammar can hold: a 400 naming it when the schema is strict, ignored when not
    unique = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    for strict, status in ((True, 400), (False, 200)):
        json_schema = {"name": "t", "schema": unique, "strict": strict}
        r = post(
            "/v1/chat/completions",
            json={**chat, "response_format": {"type": "json_schema", "json_schema": json_schema}},
        )
        assert r.status_code == status, r.text
        if strict:
            assert_error(r, 400, "response_format", contains="uniqueItems")
    output = {"format": {"type": "json_schema", "schema": unique}}  # Anthropic's: always strict
    r = post("/v1/messages", json={**messages, "output_config": output})
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"]
    # a value of the wrong JSON type is refused in OpenAI's words, never read as another ("true" is not 1)
    for field, value, words in [
        ("max_tokens", True, "expected an integer, but got a boolean instead"),
        ("max_tokens", "5", "expected an integer, but got a string instead"),
        ("max_tokens", 2.5, "expected an integer, but got a number instead"),
        ("n", True, "expected an integer, but got a boolean instead"),
        ("temperature", "0.5", "expected a number, but got a string instead"),
        ("stream", "false", "expected a boolean, but got a string instead"),
        ("seed", False, "expected an integer, but got a boolean instead"),
        ("stop_token_ids", ["2"], ""),
    ]:
        error = assert_error(post("/v1/completions", json={**PROMPT, field: value}), 400, contains=words)
        assert error["param"].startswith(field)
    r = post("/v1/messages", json={**messages, "max_tokens": True})
    assert r.status_code == 400 and "max_tokens: expected an integer" in r.json()["error"]["message"]
    r = post("/v1/responses", json={"input": "hi", "max_output_tokens": "3"})
    assert_error(r, 400, "max_output_tokens", contains="got a string")
    # an integer is a number
    assert post("/v1/completions", json={**PROMPT, "temperature": 1}).status_code == 200
    # top_p 0, which OpenAI's API takes: the most likely token alone
    assert post("/v1/completions", json={**PROMPT, "top_p": 0, "temperature": 1}).status_code == 200
    assert_error(post("/v1/completions", json={**PROMPT, "top_p": -0.1}), 400, "top_p")
    # JSON sent as a form (`curl -d` without -H) or as text: the 400 names the header, not the JSON
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        r = post("/v1/completions", content=json.dumps(PROMPT).encode(), headers={"content-type": kind})
        assert_error(r, 400, "content-type", contains="Content-Type: application/json")
    assert_error(post("/v1/completions", content=b"[1, 2]", headers={}), 400, contains="JSON object")
    r = post(
        "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"}
    )
    assert_error(r, 400, contains="UTF-8")
    # a lone surrogate escape is valid JSON but no text: the 400 says so, whichever of a field's shapes it came in
    for route, body in [
        ("/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 1}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        ),
    ]:
        r = post(route, content=body, headers={"content-type": "application/json"})
        assert_error(r, 400, contains="lone surrogate")
    # beyond the context: the numbers are in the message
    r = post("/v1/completions", json={**PROMPT, "max_tokens": 10_000})
    assert_error(r, 400, "prompt", contains="10000")
    assert str(tiny_engine.max_model_len) in r.json()["error"]["message"]
    r = post("/v1/chat/completions", json={**chat, "max_tokens": 10_000})
    assert_error(r, 400, "messages", contains="messages (")  # chat's word for the engine's prompt
    # validation by the engine (SamplingParams.validate) also names the field
    assert_error(post("/v1/completions", json={**PROMPT, "min_tokens": 9}), 400, "min_tokens")
    assert_error(post("/v1/completions", json={**PROMPT, "stop_token_ids": [10**6]}), 400, "stop_token_ids")
    assert_error(post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_error(post("/tokenize", json={}), 400)


def test_a_request_longer_than_the_context_is_a_400_clients_recognise(tiny_engine, start_server):
    """The code OpenAI's API and vLLM give (context_length_exceeded) and the words "maximum context length" on the
    OpenAI routes, Anthropic's "prompt is too long: N tokens > M maximum" on Messages: clients (LiteLLM, Claude
    Code, agent SDKs) read them to trim or compact the conversation."""
    url, _ = start_server(tiny_engine)
    limit = tiny_engine.max_model_len
    words = "word " * (2 * limit)
    chat = {"messages": [{"role": "user", "content": words}]}
    for route, body, param in [
        ("/v1/completions", {"prompt": words}, "prompt"),  # the prompt alone
        ("/v1/completions", {"prompt": "hi", "max_tokens": limit}, "prompt"),  # the prompt and max_tokens
        ("/v1/chat/completions", chat, "messages"),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": "hi"}], "max_tokens": limit},
            "messages",
        ),  # fmt: skip
        ("/v1/responses", {"input": words}, "input"),
    ]:
        error = assert_error(httpx.post(f"{url}{route}", json=body), 400, param, "maximum context length")
        assert error["code"] == "context_length_exceeded" and str(limit) in error["message"], (route, error)
    # max_completion_tokens is named as it was sent
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": limit}
    assert_error(
        httpx.post(f"{url}/v1/chat/completions", json=body), 400, "messages", "max_completion_tokens ("
    )
    r = httpx.post(f"{url}/v1/messages", json={**chat, "max_tokens": 4})
    message = assert_anthropic_error(r, 400, "invalid_request_error", "prompt is too long: ")
    n = int(message.split(": ")[1].split()[0])
    assert n > limit and message.endswith(f"tokens > {limit - 1} maximum")


def test_401_unless_the_key_matches(tiny_engine, start_server):
    url, _ = start_server(tiny_engine, api_key="sesame")
    for headers in [
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": "sesame"},
        {"Authorization": "Basic x"},
    ]:
        error = assert_error(httpx.post(f"{url}/v1/completions", json=PROMPT, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
        assert_error(httpx.get(f"{url}/v1/models", headers=headers), 401)
    good = {"Authorization": "Bearer sesame"}
    assert httpx.post(f"{url}/v1/completions", json=PROMPT, headers=good).status_code == 200
    assert httpx.post(f"{url}/tokenize", json={"prompt": "a"}, headers=good).status_code == 200
    # health and metrics are open for probes and scrapers
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_404_unknown_model_and_route(tiny_engine, start_server):
    url, _ = start_server(tiny_engine)
    error = assert_error(httpx.post(f"{url}/v1/completions", json={**PROMPT, "model": "gpt-9"}), 404, "model")
    assert error["code"] == "model_not_found"
    assert httpx.post(f"{url}/v1/completions", json={**PROMPT, "model": "test-model"}).status_code == 200
    assert_error(httpx.get(f"{url}/v2/nothing"), 404)


def test_head_is_get_without_the_body_on_every_route(tiny_engine, start_server):
    """Clients probe with HEAD (Claude Code sends `HEAD /` as it starts): every GET route answers it with the
    GET's status and headers and an empty body, the key checked as for GET; elsewhere it gets what GET gets."""
    url, app = start_server(tiny_engine, api_key="sesame")
    client = httpx.Client(base_url=url)
    # the path parameters of the GET routes
    examples = {"name": "index.html", "model": "test-model", "response_id": "resp_1"}
    routers = (routes.health_router, routes.api_router, openai_routes.router, anthropic_routes.router)
    routers += (fleet.public_router, fleet.router, ui.ui_router)
    paths = [
        r.path_format.format(**examples) for router in routers for r in router.routes if "GET" in r.methods
    ]
    assert {"/", "/health", "/metrics", "/v1/models", "/is_sleeping", "/server_info"} <= set(paths)
    for path in [*paths, "/v2/nothing", "/v1/messages"]:
        for headers in ({}, {"x-api-key": "sesame"}):
            get, head = client.get(path, headers=headers), client.head(path, headers=headers)
            assert head.status_code == get.status_code and head.content == b"", path
            assert head.headers["content-type"] == get.headers["content-type"], path
            if path != "/metrics":  # its counters move between the two requests
                assert head.headers["content-length"] == str(len(get.content)), path
    assert client.head("/v1/models").status_code == 401 and client.head("/").status_code == 200
    assert client.head("/v1/messages").status_code == 405


def test_413_by_content_length_and_by_counting(tiny_engine, start_server):
    url, _ = start_server(tiny_engine, max_request_bytes=1000)
    body = json.dumps({**PROMPT, "prompt": "x" * 2000}).encode()
    assert_error(httpx.post(f"{url}/v1/completions", content=body), 413, contains="1000")
    # chunked transfer: no Content-Length, so the bytes are counted as they arrive
    chunks = iter([body[:600], body[600:1200], body[1200:]])
    assert_error(httpx.post(f"{url}/v1/completions", content=chunks), 413)
    assert httpx.post(f"{url}/v1/completions", json=PROMPT).status_code == 200


def test_429_when_the_queue_is_full(long_engine, start_server, wait_for):
    url, _ = start_server(long_engine, max_queue=1)
    with httpx.Client(base_url=url, timeout=30) as a, httpx.Client(base_url=url, timeout=30) as b:
        with a.stream("POST", "/v1/completions", json=LONG) as running:
            assert running.status_code == 200
            wait_for(lambda: long_engine.stats().num_running == 1, what="one running")
            with b.stream("POST", "/v1/completions", json=LONG) as waiting:
                assert waiting.status_code == 200
                wait_for(lambda: long_engine.stats().num_waiting == 1, what="one waiting")
                r = httpx.post(f"{url}/v1/completions", json=PROMPT)
                assert_error(r, 429)
                assert int(r.headers["retry-after"]) >= 1
    wait_for(lambda: long_engine.stats().num_running + long_engine.stats().num_waiting == 0, what="aborts")
    assert httpx.post(f"{url}/v1/completions", json=PROMPT).status_code == 200


def test_one_request_cannot_fill_the_queue_by_fanning_out(tiny_engine, start_server):
    """Prompts x n engine requests count against --max-queue: more than it holds is a 400 that says so, and one
    that would overflow what is already waiting a 429; before, one request of 256 prompts x 16 queued 4,096 and
    every other client got 429 until they were done (hostile-input audit)."""
    url, _ = start_server(tiny_engine, max_queue=8)
    body = {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}
    error = assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "n", "--max-queue 8")
    assert "9 sequences" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 9, "max_tokens": 1}
    assert_error(httpx.post(f"{url}/v1/chat/completions", json=chat), 400, "n")
    prompts = {"prompt": ["p"] * 9, "max_tokens": 1}
    assert_error(httpx.post(f"{url}/v1/completions", json=prompts), 400, "prompt")
    r = httpx.post(f"{url}/v1/completions", json={**body, "n": 2})  # 6: fits
    assert r.status_code == 200 and len(r.json()["choices"]) == 6


def test_503_while_loading_then_ready(tiny_engine, start_server, scrape):
    url, app = start_server(None)
    assert_error(httpx.get(f"{url}/health"), 503, contains="loading")
    for r in [httpx.post(f"{url}/v1/completions", json=PROMPT), httpx.get(f"{url}/v1/models")]:
        assert_error(r, 503, contains="loading")
    assert scrape(url)["kvserve:num_requests_running"] == 0  # metrics answer while loading
    set_engine(app, tiny_engine)
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.post(f"{url}/v1/completions", json=PROMPT).status_code == 200


def test_draining_finishes_running_requests_and_refuses_new_ones(long_engine, start_server, wait_for):
    url, app = start_server(long_engine)
    body = {**LONG, "max_tokens": 300}
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as running:
            wait_for(lambda: long_engine.stats().num_running == 1, what="running")
            begin_drain(app)
            assert_error(httpx.get(f"{url}/health"), 503, contains="shutting down")
            assert_error(httpx.post(f"{url}/v1/completions", json=PROMPT), 503, contains="shutting down")
            events = [line for line in running.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_drain_timeout_aborts_what_is_still_running(long_engine, start_server, wait_for):
    url, app = start_server(long_engine, shutdown_timeout=0.3)
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=LONG) as running:
            wait_for(lambda: long_engine.stats().num_running == 1, what="running")
            asyncio.run(drain(app))
            events = [line for line in running.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    wait_for(lambda: long_engine.stats().kv_cache_usage == 0, timeout=2, what="blocks freed")


def test_500_is_generic(tiny_engine, start_server, monkeypatch):
    url, _ = start_server(tiny_engine)

    async def broken(*args):
        raise RuntimeError("secret detail in /srv/kvserve/server/api/serving.py")

    monkeypatch.setattr(openai_routes, "completion", broken)
    error = assert_error(httpx.post(f"{url}/v1/completions", json=PROMPT), 500)
    assert "secret" not in error["message"]


def test_request_id_is_echoed_or_made(tiny_engine, start_server):
    url, _ = start_server(tiny_engine)
    r = httpx.post(f"{url}/v1/completions", json=PROMPT, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    made = httpx.get(f"{url}/health").headers["x-request-id"]
    assert len(made) == 32
    # an id that could forge log lines or headers is replaced, not echoed
    assert httpx.get(f"{url}/health", headers={"X-Request-Id": "a b\tc"}).headers["x-request-id"] != "a b\tc"
    error_id = httpx.get(f"{url}/v2/nothing", headers={"X-Request-Id": "e-1"}).headers["x-request-id"]
    assert error_id == "e-1"


def test_cors_headers_only_when_origins_are_allowed(tiny_engine, start_server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    url, _ = start_server(tiny_engine)
    r = httpx.options(f"{url}/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    url, _ = start_server(tiny_engine, allowed_origins=["https://app.example"], api_key="k")
    r = httpx.options(f"{url}/v1/completions", headers=preflight)  # a preflight carries no key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.get(f"{url}/health", headers={"Origin": "https://app.example"})
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_one_log_line_per_request_without_the_prompt(tiny_engine, start_server, caplog):
    url, _ = start_server(tiny_engine)
    with caplog.at_level(logging.INFO, logger="server.api.serving"):
        body = {"prompt": "my secret prompt", "max_tokens": 3, "n": 2, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "log-1"})
    (line,) = [r.getMessage() for r in caplog.records if "log-1" in r.getMessage()]
    assert "+ 6 output tokens" in line and "ttft" in line and "finish length" in line
    assert "secret" not in caplog.text


# --- Anthropic's route, and the Responses route ---------------------------------------------------

MESSAGE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def assert_anthropic_error(r: httpx.Response, status: int, kind: str, contains: str = "") -> str:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}; returns the message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and 0 < len(body["error"]["message"]) <= 300
    assert contains in body["error"]["message"]
    assert "Traceback" not in r.text and ".py" not in r.text
    return body["error"]["message"]


def test_anthropic_route_errors_in_anthropics_shape(tiny_engine, start_server, monkeypatch):
    url, app = start_server(tiny_engine, api_key="k", max_request_bytes=2000)
    key = {"x-api-key": "k"}
    post = httpx.Client(base_url=url, headers=key).post
    cases = [
        ({"messages": MESSAGE["messages"]}, "max_tokens"),
        ({**MESSAGE, "messages": []}, "messages"),
        ({**MESSAGE, "temperature": -1}, "temperature"),
        ({**MESSAGE, "stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({**MESSAGE, "tool_choice": {"type": "tool", "name": "f"}}, "tool_choice"),
        ({**MESSAGE, "system": [{"type": "image"}]}, "image"),
        ({**MESSAGE, "max_tokens": 0}, "max_tokens"),
    ]
    for body, contains in cases:
        assert_anthropic_error(post("/v1/messages", json=body), 400, "invalid_request_error", contains)
    raw = {"content-type": "application/json", **key}
    assert_anthropic_error(post("/v1/messages", content=b"{bad", headers=raw), 400, "invalid_request_error")
    for headers in [{}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}]:
        r = httpx.post(f"{url}/v1/messages", json=MESSAGE, headers=headers)
        assert_anthropic_error(r, 401, "authentication_error")
    assert (
        httpx.post(f"{url}/v1/messages", json=MESSAGE, headers={"Authorization": "Bearer k"}).status_code
        == 200
    )
    assert post("/v1/messages", json=MESSAGE).status_code == 200
    assert (
        post("/v1/chat/completions", json={"messages": MESSAGE["messages"]}).status_code == 200
    )  # x-api-key
    assert_anthropic_error(post("/v1/messages", json={**MESSAGE, "model": "claude"}), 404, "not_found_error")
    assert_anthropic_error(post("/v1/messages/nothing", json=MESSAGE), 404, "not_found_error")
    big = {**MESSAGE, "system": "x" * 3000}
    assert_anthropic_error(post("/v1/messages", json=big), 413, "request_too_large")
    r = post("/v1/messages/count_tokens", json={"messages": MESSAGE["messages"], "model": "test-model"})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    begin_drain(app)
    assert_anthropic_error(post("/v1/messages", json=MESSAGE), 503, "overloaded_error", "shutting down")
    app.state.draining = False

    async def broken(*args):
        raise RuntimeError("secret detail in /srv/kvserve/server/api/messages.py")

    monkeypatch.setattr(anthropic_routes, "message", broken)
    assert "secret" not in assert_anthropic_error(post("/v1/messages", json=MESSAGE), 500, "api_error")
    # the other routes keep OpenAI's shape
    assert_error(
        post("/v1/responses", json={"input": "hi", "max_output_tokens": 0}), 400, "max_output_tokens"
    )
    assert_error(httpx.post(f"{url}/v1/responses", json={"input": "hi"}), 401)


@pytest.mark.parametrize(
    "route, body", [("/v1/messages", MESSAGE), ("/v1/responses", {"input": "hi", "max_output_tokens": 4})]
)
def test_429_on_the_new_routes(route, body, long_engine, start_server, wait_for):
    url, _ = start_server(long_engine, max_queue=1)
    with httpx.Client(base_url=url, timeout=30) as a, httpx.Client(base_url=url, timeout=30) as b:
        with a.stream("POST", "/v1/completions", json=LONG):
            wait_for(lambda: long_engine.stats().num_running == 1, what="one running")
            with b.stream("POST", "/v1/completions", json=LONG):
                wait_for(lambda: long_engine.stats().num_waiting == 1, what="one waiting")
                r = httpx.post(f"{url}{route}", json=body)
                assert int(r.headers["retry-after"]) >= 1
                if route == "/v1/messages":
                    assert_anthropic_error(r, 429, "rate_limit_error")
                else:
                    assert_error(r, 429)
    wait_for(lambda: long_engine.stats().num_running + long_engine.stats().num_waiting == 0, what="aborts")


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/responses"])
def test_drain_timeout_ends_the_new_routes_streams_with_a_failure(
    route, long_engine, start_server, wait_for, named_sse_events
):
    url, app = start_server(long_engine, shutdown_timeout=0.3)
    body = (
        {**MESSAGE, "max_tokens": 4000}
        if route == "/v1/messages"
        else {"input": "hi", "max_output_tokens": 4000}
    )
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", route, json={**body, "ignore_eos": True, "stream": True}) as running:
            wait_for(lambda: long_engine.stats().num_running == 1, what="running")
            asyncio.run(drain(app))
            events = named_sse_events(running.read())
    if route == "/v1/messages":  # Anthropic has no stop reason for it: the stream ends with an error event
        assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "overloaded_error"
    else:
        assert events[-1]["type"] == "response.failed"
        assert events[-1]["response"]["error"]["code"] == "server_error"
    wait_for(lambda: long_engine.stats().kv_cache_usage == 0, timeout=2, what="blocks freed")


SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "x",
        "schema": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
    },
}


@pytest.fixture(scope="module")
def tight_grammar_engine(tiny_llama_dir):
    """The tiny model whose grammars get llguidance's per-token lexer fuel cut to almost nothing: an ordinary
    schema compiles (its first mask fits) and fails a few tokens into the output."""

    def build() -> Engine:
        engine = Engine(str(tiny_llama_dir), EngineConfig(kv_cache_memory=64 << 20))
        limits = llguidance.LLParserLimits(step_lexer_fuel=5)
        engine.grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, limits)
        return engine

    engine = AsyncEngine(build)
    yield engine
    engine.shutdown()


def test_a_grammar_failing_midway_is_a_400_or_an_error_event_naming_the_grammar(
    tight_grammar_engine, start_server, sse_events, named_sse_events
):
    url, _ = start_server(tight_grammar_engine)
    chat = {**MESSAGE, "max_tokens": 40, "temperature": 0, "response_format": SCHEMA_FORMAT}
    with httpx.Client(base_url=url, timeout=30) as client:
        # named by the field the grammar came from, as a grammar refused at its compile is
        error = assert_error(
            client.post("/v1/chat/completions", json=chat), 400, "response_format", "grammar failed after"
        )
        assert error["type"] == "invalid_request_error" and "<state>" not in error["message"]
        events = sse_events(client.post("/v1/chat/completions", json={**chat, "stream": True}).content)
        assert events[-1]["error"]["type"] == "invalid_request_error"
        assert "grammar failed after" in events[-1]["error"]["message"]
        assert events[-1]["error"]["param"] == "response_format"
        schema = SCHEMA_FORMAT["json_schema"]["schema"]
        messages = {
            **MESSAGE,
            "max_tokens": 40,
            "temperature": 0,  # sampled, a short enough reply ("{"id": 0}") could end within the fuel
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        }
        r = client.post("/v1/messages", json=messages)
        assert_anthropic_error(r, 400, "invalid_request_error", "grammar failed after")
        events = named_sse_events(client.post("/v1/messages", json={**messages, "stream": True}).content)
        assert events[-1]["type"] == "error" and "grammar failed after" in events[-1]["error"]["message"]
        # the server goes on: a free-text request after them is answered
        assert client.post("/v1/chat/completions", json=MESSAGE).status_code == 200
    assert tight_grammar_engine.stats().kv_cache_usage == 0


def test_a_grammar_too_deep_to_compile_is_a_400_and_the_server_goes_on(tiny_engine, start_server):
    """A Lark grammar chaining 3,000 rules, and a schema chaining 3,000 $refs, overflowed llguidance's stack
    and killed the whole server; each is a 400 naming its field, and the next request is served."""
    url, _ = start_server(tiny_engine)
    chain = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "x"\n'
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}
    schema = {"$defs": {**defs, "d3000": {"type": "integer"}}, "$ref": "#/$defs/d0"}
    refs = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with httpx.Client(base_url=url, timeout=30) as client:
        lark = {**PROMPT, "structured_outputs": {"grammar": chain}}
        assert_error(client.post("/v1/completions", json=lark), 400, "structured_outputs", "nests too deeply")
        r = client.post("/v1/chat/completions", json={**MESSAGE, "response_format": refs})
        assert_error(r, 400, "response_format", "nests too deeply")
        assert client.post("/v1/completions", json=PROMPT).status_code == 200


def test_a_request_may_name_the_model_by_any_of_its_served_names(tiny_engine, start_server, caplog):
    """vLLM's --served-model-name with several names: any is accepted, all are listed, replies carry the first;
    --disable-log-requests leaves out the line per request."""
    caplog.set_level("INFO")
    url, _ = start_server(
        tiny_engine, served_model_name="first", model_aliases=["gpt-4o"], log_requests=False
    )
    listed = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["first", "gpt-4o"]
    assert httpx.get(f"{url}/v1/models/gpt-4o").json()["id"] == "gpt-4o"
    r = httpx.post(
        f"{url}/v1/completions", json={"model": "gpt-4o", "prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200 and r.json()["model"] == "first"
    assert_error(httpx.post(f"{url}/v1/completions", json={"model": "other", "prompt": "hi"}), 404, "model")
    assert "prompt + " not in caplog.text  # no request line
