"""/v1/messages through the official anthropic SDK (messages.create, messages.stream, count_tokens) against a
live server on the real default model: text, stop sequences, JSON-schema output, a tool loop, streaming, and
errors in Anthropic's shape. Run with -s to see the streamed output."""

import json
import logging

import anthropic
import jsonschema
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME_TOOL = {
    "name": "get_time",
    "description": "The local time in a time zone",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Sampling fields go in the body: the newest SDKs dropped temperature, top_p and top_k from their signatures
# (Anthropic's newest models fix them), and the API still takes them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(default_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=default_server, api_key="unused", max_retries=0, timeout=120)


def show(title: str, events: list) -> None:
    """The stream as it came, one event a line (deltas shown as their text); the SDK's own derived events
    (text, input_json) are left out."""
    print(f"\n--- {title}")
    for e in (e for e in events if e.type not in ("text", "input_json")):
        delta = getattr(e, "delta", None)
        detail = getattr(delta, "text", None) or getattr(delta, "partial_json", None) or ""
        if e.type == "content_block_start":
            detail = e.content_block.type
        elif e.type == "message_delta":
            detail = f"stop_reason={delta.stop_reason} output_tokens={e.usage.output_tokens}"
        print(f"  {e.type:20s} {detail!r}" if detail else f"  {e.type}")


def test_text_streamed_and_not(client):
    kw = dict(model="smollm2", system="You are terse.", messages=QUESTION, max_tokens=24, extra_body=GREEDY)
    m = client.messages.create(**kw)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "smollm2"
    (block,) = m.content
    assert block.type == "text" and block.text and m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 10 and 0 < m.usage.output_tokens <= 24
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    show("messages.stream, text", events)
    print("final:", final.content[0].text)
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.content[0].text == block.text
    assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
    assert [e.type for e in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_stop_sequences_and_max_tokens(client):
    kw = dict(model="smollm2", messages=QUESTION)
    free = client.messages.create(**kw, max_tokens=24, extra_body=GREEDY).content[0].text
    word = free.split()[2]  # a word the greedy answer writes: asking to stop there ends it before the word
    m = client.messages.create(**kw, max_tokens=24, stop_sequences=["zzz", word], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert free.startswith(m.content[0].text) and word not in m.content[0].text
    cut = client.messages.create(**kw, max_tokens=2, extra_body={**GREEDY, "ignore_eos": True})
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_a_prefilled_reply_is_continued(client):
    """Anthropic's prefill: a final assistant message is the reply's start; the model writes on from it and the
    reply holds only what follows (the default model puts ' Paris' first at p ~0.95 after this one)."""
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    kw = dict(model="smollm2", messages=prefill, max_tokens=8, extra_body=GREEDY)
    (block,) = client.messages.create(**kw).content
    assert block.text.startswith(" Paris"), block.text
    with client.messages.stream(**kw) as stream:
        assert stream.get_final_message().content[0].text == block.text
    # the prefill's few tokens after the question's prompt (which ends with the assistant's turn opening)
    question = client.messages.count_tokens(model="smollm2", messages=QUESTION).input_tokens
    assert (
        question < client.messages.count_tokens(model="smollm2", messages=prefill).input_tokens < question + 8
    )


def test_json_schema_output(client):
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["title", "year"],
        "additionalProperties": False,
    }
    m = client.messages.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Recommend a film."}],
        max_tokens=80,
        extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_tool_loop_use_result_answer(client):
    tools = [WEATHER_TOOL, TIME_TOOL]
    first = client.messages.create(
        model="smollm2",
        messages=ASK_WEATHER,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=80,
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    jsonschema.validate(
        use.input, {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[use.name]["input_schema"]
    )
    print("\ntool_use ->", use.name, use.input)
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}],
        },
    ]
    answer = client.messages.create(
        model="smollm2", messages=messages, tools=tools, max_tokens=40, extra_body=GREEDY
    )
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    print("answer ->", answer.content[0].text)
    count = client.messages.count_tokens(model="smollm2", messages=messages, tools=tools)
    assert count.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


def test_streamed_tool_use(client):
    with client.messages.stream(
        model="smollm2",
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=80,
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    show("messages.stream, tool_use", events)
    (use,) = final.content
    print("final:", use.name, use.input)
    assert use.type == "tool_use" and use.name == "get_weather" and final.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER_TOOL["input_schema"])
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(partial) > 3 and json.loads("".join(partial)) == use.input


def test_errors_in_anthropics_shape(client, default_server):
    def refused(error: type, **kw) -> dict:
        with pytest.raises(error) as e:
            client.messages.create(**{"model": "smollm2", "max_tokens": 8, "messages": QUESTION, **kw})
        body = e.value.body
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    assert (
        "image"
        in refused(anthropic.BadRequestError, messages=[{"role": "user", "content": [image]}])["message"]
    )
    tool = {"type": "web_search_20250305", "name": "web_search"}
    assert "web_search_20250305" in refused(anthropic.BadRequestError, tools=[tool])["message"]
    assert (
        refused(anthropic.BadRequestError, extra_body={"temperature": -1})["type"] == "invalid_request_error"
    )
    assert refused(anthropic.NotFoundError, model="claude-opus-4")["type"] == "not_found_error"
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}
    assert "toolu_x" in refused(anthropic.BadRequestError, messages=[result])["message"]
    prefill = [
        *QUESTION,
        {"role": "assistant", "content": "The capital "},
    ]  # Anthropic's rule: no trailing space
    assert "trailing whitespace" in refused(anthropic.BadRequestError, messages=prefill)["message"]


def test_claude_codes_requests(default_server, caplog):
    """A tool round trip shaped as Claude Code 2.1 sends it (its real requests run in test_claude_code.py): the
    beta route (?beta=true, anthropic-beta), its billing line first in the system prompt, a system message after
    the first user turn, and thinking, context_management, output_config.effort and metadata, which kvserve
    accepts and does not use."""
    sdk = anthropic.Anthropic(base_url=default_server, api_key="unused", max_retries=0, timeout=120)
    agents = {
        "role": "system",
        "content": [
            {"type": "text", "text": "Agents: none.", "cache_control": {"type": "ephemeral"}},
        ],
    }
    billing = {
        "type": "text",
        "text": "x-anthropic-billing-header: cc_version=2.1.200.b31; cc_entrypoint=sdk-cli;",
    }
    terse = {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}
    # Claude Code's attribution line, different in each conversation, is left out of the prompt
    counted = [
        sdk.messages.count_tokens(model="smollm2", system=system, messages=ASK_WEATHER).input_tokens
        for system in ([billing, terse], [terse])
    ]
    assert counted[0] == counted[1]
    common = dict(
        model="smollm2",
        max_tokens=32000,  # more than the context holds: what fits is generated
        system=[billing, terse],
        tools=[WEATHER_TOOL, TIME_TOOL],
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        metadata={"user_id": '{"device_id": "d", "session_id": "s"}'},
        betas=["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27"],
        extra_query={"beta": "true"},  # Claude Code's SDK adds it on the beta route
    )
    asked = [*ASK_WEATHER, agents]
    with caplog.at_level(logging.DEBUG, logger="server.api.anthropic.messages"):
        with sdk.beta.messages.stream(
            messages=asked,
            thinking={"type": "adaptive", "display": "omitted"},
            tool_choice={"type": "tool", "name": "get_weather"},  # Claude Code leaves it to the model
            extra_body=GREEDY,
            **common,
        ) as stream:
            first = stream.get_final_message()
            sent = stream.response.request
    assert sent.url.path == "/v1/messages" and sent.url.query == b"beta=true"
    assert "context-management-2025-06-27" in sent.headers["anthropic-beta"]
    assert "accepted, not used: context_management, metadata, output_config.effort" in caplog.text
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and first.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "18 C"}]}
    with sdk.beta.messages.stream(
        messages=[
            *asked,
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [result]},
        ],
        thinking={
            "type": "enabled",
            "budget_tokens": 1024,
        },  # older Claude Codes' shape: no thinking is written
        extra_body={**GREEDY, "max_tokens": 40},
        **common,
    ) as stream:
        answer = stream.get_final_message()
    print("\nClaude Code shaped:", use.input, "->", [b.model_dump() for b in answer.content])
    assert answer.content and all(b.type in ("text", "tool_use") for b in answer.content)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
