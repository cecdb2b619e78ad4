"""/v1/responses through the official openai SDK (responses.create, responses.stream, responses.parse) against a
live server on the real default model: text, JSON-schema output, a tool loop, streaming, namespace and custom
tools, built-in tools left out, requests shaped as Codex sends them, and what is refused.
Run with -s to see the streamed output."""

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME_TOOL = {
    "type": "function",
    "name": "get_time",
    "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
ASK_WEATHER = "What is the weather like in Paris today?"
WEATHER_NAMESPACE = {  # as Codex groups its sub-agent tools, and an MCP server's
    "type": "namespace",
    "name": "weather",
    "description": "Weather and time",
    "tools": [WEATHER_TOOL, TIME_TOOL],
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}  # as Codex sends it
NOTE_TOOL = {  # a custom (freeform) tool: its input is text, here in a Lark grammar's language
    "type": "custom",
    "name": "write_note",
    "description": "Write a short note",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "NOTE: " /[A-Za-z ]+/'},
}


class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0, le=100_000_000)  # bounded, or a greedy small model writes digits forever


@pytest.fixture(scope="module")
def client(default_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=120)


def show(title: str, events: list) -> None:
    """The stream as it came, one event a line (deltas shown as their text)."""
    print(f"\n--- {title}")
    for e in events:
        detail = getattr(e, "delta", None) or getattr(getattr(e, "item", None), "type", None) or ""
        print(
            f"  {e.sequence_number:3d} {e.type:42s} {detail!r}"
            if detail
            else f"  {e.sequence_number:3d} {e.type}"
        )


def test_text_streamed_and_not(client):
    kw = dict(
        model="smollm2",
        instructions="You are terse.",
        input="What is the capital of France?",
        max_output_tokens=24,
        temperature=0,
    )
    r = client.responses.create(**kw)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "smollm2"
    assert r.status in ("completed", "incomplete") and r.output_text
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    u = r.usage
    assert (
        u.input_tokens > 10
        and 0 < u.output_tokens <= 24
        and u.total_tokens == u.input_tokens + u.output_tokens
    )
    assert (
        u.input_tokens_details.cached_tokens >= 0 and r.store is True and r.instructions == "You are terse."
    )
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    show("responses.stream, text", events)
    print("final:", final.output_text)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == r.output_text
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert final.usage.output_tokens == u.output_tokens
    # completed_at only once completed, as OpenAI's
    assert (r.completed_at is None) == (r.status != "completed")
    assert final.completed_at >= final.created_at and events[0].response.completed_at is None


def test_logprobs_of_the_output_text_as_chat_gives_them(client):
    question = "Name three colours."
    kw = dict(model="smollm2", input=question, max_output_tokens=8, temperature=0)
    r = client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=2)
    (part,) = r.output[0].content
    assert len(part.logprobs) == r.usage.output_tokens == 8
    assert b"".join(bytes(lp.bytes) for lp in part.logprobs).decode() == part.text
    for lp in part.logprobs:  # greedy: the token is the likeliest of its alternatives
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token
        assert lp.logprob <= 0 and lp.top_logprobs[1].logprob <= lp.top_logprobs[0].logprob == lp.logprob
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    expected = chat.choices[0].logprobs.content
    assert [(lp.token, round(lp.logprob, 4)) for lp in part.logprobs] == [
        (lp.token, round(lp.logprob, 4)) for lp in expected
    ]
    # streamed: the deltas carry them, the done events and the final response hold them all
    events = list(client.responses.create(**kw, include=["message.output_text.logprobs"], stream=True))
    final = events[-1].response  # response.incomplete: cut at max_output_tokens
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    tokens = [lp.token for lp in expected]
    assert [lp.token for lp in streamed] == [lp.token for lp in done.logprobs] == tokens
    held = [lp.model_dump() for lp in final.output[0].content[0].logprobs]
    assert held == [lp.model_dump() for lp in done.logprobs] and not streamed[0].top_logprobs
    # not asked for: none
    assert client.responses.create(**kw).output[0].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.responses.create(**kw, top_logprobs=21)


def test_input_items_and_a_length_cut(client):
    r = client.responses.create(
        model="smollm2",
        input=[
            {"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
            {"role": "user", "content": "Another one, and explain why at length."},
        ],
        max_output_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_json_schema_output_and_parse(client):
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["title", "year"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="smollm2",
        input="Recommend a film.",
        text={"format": {"type": "json_schema", "name": "film", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=80,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    parsed = client.responses.parse(
        model="smollm2",
        input="Describe Paris as a city record.",
        text_format=City,
        temperature=0,
        max_output_tokens=60,
    )
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name
    print("\nresponses.parse ->", parsed.output_parsed)


def test_tool_loop_call_output_answer(client):
    tools = [WEATHER_TOOL, TIME_TOOL]
    first = client.responses.create(
        model="smollm2",
        input=ASK_WEATHER,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=80,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    schema = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.name]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)
    print("\ncall ->", call.name, call.arguments)
    # the client sends the output back, with the call's result: the whole conversation each time
    conversation = [{"role": "user", "content": ASK_WEATHER}, *[o.model_dump() for o in first.output]]
    conversation.append({"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"})
    answer = client.responses.create(
        model="smollm2", input=conversation, tools=tools, temperature=0, max_output_tokens=40
    )
    assert answer.output_text and all(o.type == "message" for o in answer.output)
    print("answer ->", answer.output_text)


def test_streamed_tool_call_and_named_choice(client):
    with client.responses.stream(
        model="smollm2",
        input=ASK_WEATHER,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=80,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    show("responses.stream, tool call", events)
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    # the choice is echoed as it was sent, without a namespace key it did not have
    assert final.tool_choice.model_dump(exclude_unset=True) == {"type": "function", "name": "get_weather"}
    print("final:", call.name, call.arguments)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments


def test_namespace_tools_flattened_and_calls_mapped_back(client):
    """The model is offered weather.get_weather and weather.get_time; its call comes back as Codex runs it:
    the tool's own name, and the namespace apart."""
    kw = dict(model="smollm2", input=ASK_WEATHER, temperature=0, max_output_tokens=80)
    first = client.responses.create(
        **kw, tools=[WEATHER_NAMESPACE, WEB_SEARCH], tool_choice="required", parallel_tool_calls=False
    )
    (call,) = first.output
    assert call.type == "function_call" and call.namespace == "weather"
    assert call.name in ("get_weather", "get_time") and call.status == "completed"
    jsonschema.validate(
        json.loads(call.arguments),
        {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.name]["parameters"],
    )
    print("\ncall ->", call.namespace, call.name, call.arguments)
    # a named choice: the name as the model knows it, or the namespace apart; streamed
    for choice in (
        {"type": "function", "name": "weather.get_time"},
        {"type": "function", "name": "get_time", "namespace": "weather"},
    ):
        with client.responses.stream(**kw, tools=[WEATHER_NAMESPACE], tool_choice=choice) as stream:
            events = list(stream)
            final = stream.get_final_response()
        (named,) = final.output
        assert (named.type, named.namespace, named.name) == ("function_call", "weather", "get_time")
        (added,) = [e for e in events if e.type == "response.output_item.added"]
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert (
            added.item.namespace == "weather"
            and done.name == "get_time"
            and done.arguments == named.arguments
        )
    show("responses.stream, namespaced call", events)
    # the call goes back as it came, namespace and all, with its output; the model answers
    conversation = [{"role": "user", "content": ASK_WEATHER}, call.model_dump(exclude_none=True)]
    conversation.append({"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"})
    answer = client.responses.create(
        model="smollm2", input=conversation, tools=[WEATHER_NAMESPACE], temperature=0, max_output_tokens=40
    )
    assert answer.output_text and all(o.type == "message" for o in answer.output)
    print("answer ->", answer.output_text)


def test_custom_tool_takes_text(client):
    """A custom tool is offered as a function of one string, `input`; its call comes back as a
    custom_tool_call whose input is that text, streamed as custom_tool_call_input events."""
    # the input named in the prompt: asked only to "write a note saying hello", the greedy 135M model loops
    # ("This is a note. This is a note. ...") with some tiers' roundings, and the call never ends
    kw = dict(
        model="smollm2", input="Call write_note with the input: Hello", temperature=0, max_output_tokens=60
    )
    with client.responses.stream(
        **kw, tools=[NOTE_TOOL], tool_choice={"type": "custom", "name": "write_note"}
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    show("responses.stream, custom tool call", events)
    (call,) = final.output
    assert call.type == "custom_tool_call" and call.name == "write_note" and call.namespace is None
    assert call.call_id.startswith("call_") and call.id.startswith("ctc_") and isinstance(call.input, str)
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert done.input == "".join(deltas) == call.input
    assert not [e for e in events if e.type.startswith("response.function_call_arguments")]
    print("final:", call.name, repr(call.input))
    same = client.responses.create(
        **kw, tools=[NOTE_TOOL], tool_choice={"type": "custom", "name": "write_note"}
    )
    assert same.output[0].type == "custom_tool_call" and same.output[0].input == call.input
    # in a namespace too, and back with its output
    grouped = {"type": "namespace", "name": "notes", "description": "Notes", "tools": [NOTE_TOOL]}
    r = client.responses.create(**kw, tools=[grouped], tool_choice="required")
    (call,) = r.output
    assert (call.type, call.namespace, call.name) == ("custom_tool_call", "notes", "write_note")
    conversation = [{"role": "user", "content": kw["input"]}, call.model_dump(exclude_none=True)]
    conversation.append({"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Saved."})
    answer = client.responses.create(
        model="smollm2", input=conversation, tools=[grouped], temperature=0, max_output_tokens=30
    )
    assert answer.output_text and all(o.type == "message" for o in answer.output)


def test_builtin_tools_left_out_and_named_in_a_header(client, default_server):
    """Tools OpenAI runs itself are not refused: they are left out of the prompt, and the response says so."""
    builtins = [
        WEB_SEARCH,
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "mcp", "server_label": "docs", "server_url": "https://mcp.example"},
        {"type": "web_search"},
    ]
    body = {
        "model": "smollm2",
        "input": "hi",
        "max_output_tokens": 8,
        "temperature": 0,
        "tools": [*builtins, TIME_TOOL],
    }
    for streamed in (False, True):
        r = httpx.post(f"{default_server}/v1/responses", json={**body, "stream": streamed}, timeout=120)
        assert r.status_code == 200 and r.headers["x-kvserve-ignored-tools"] == "web_search, file_search, mcp"
    echoed = json.loads(httpx.post(f"{default_server}/v1/responses", json=body, timeout=120).text)["tools"]
    assert echoed[0] == WEB_SEARCH and [t["type"] for t in echoed] == [
        *(t["type"] for t in builtins),
        "function",
    ]
    r = httpx.post(f"{default_server}/v1/responses", json={**body, "tools": [TIME_TOOL]}, timeout=120)
    assert r.status_code == 200 and "x-kvserve-ignored-tools" not in r.headers
    only = client.responses.create(
        model="smollm2", input="Say hi.", tools=[WEB_SEARCH], temperature=0, max_output_tokens=8
    )
    assert only.output_text and only.output[0].type == "message"


def test_requests_shaped_as_codex_sends_them(client):
    """The fields Codex sends with every request are accepted (and change nothing kvserve does): developer
    messages with ids, reasoning, include, store false, prompt_cache_key, client_metadata, text.verbosity; and
    the history it sends back: calls with their status, id and namespace, outputs with their ids."""
    tools = [
        {"type": "function", "name": "exec_command", "description": "Run a shell command", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                        "additionalProperties": False}},
        WEATHER_NAMESPACE,
        WEB_SEARCH,
    ]  # fmt: skip
    codex = dict(
        model="smollm2",
        tools=tools,
        tool_choice="auto",
        parallel_tool_calls=True,
        reasoning={"summary": "auto"},
        store=False,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="0198-session",
        text={"verbosity": "low"},
        extra_body={"client_metadata": {"session_id": "0198-session", "turn_id": "1"}},
        temperature=0,
        max_output_tokens=24,
    )
    developer = {"type": "message", "id": "msg_1", "role": "developer",
                 "content": [{"type": "input_text", "text": "You are a coding agent. Answer briefly."}]}  # fmt: skip
    user = {
        "type": "message",
        "id": "msg_2",
        "role": "user",
        "content": [{"type": "input_text", "text": "Hi."}],
    }
    with client.responses.create(input=[developer, user], stream=True, **codex) as stream:
        events = list(stream)
    final = events[-1].response  # completed, or incomplete when max_output_tokens cut it
    assert final.status in ("completed", "incomplete") and final.text.verbosity == "low"
    history = [
        developer,
        user,
        {"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "call_1", "name": "get_time",
         "namespace": "weather", "arguments": '{"zone": "UTC"}'},
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "12:00"},
        {"type": "function_call", "call_id": "call_2", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "README.md"}]},
    ]  # fmt: skip
    r = client.responses.create(input=history, **codex)
    assert r.status in ("completed", "incomplete") and r.output


def test_a_stored_response_is_continued_retrieved_and_deleted(client):
    kw = dict(model="smollm2", max_output_tokens=12, temperature=0)
    first = client.responses.create(input="My name is Ada. Say hello.", instructions="Be brief.", **kw)
    assert first.store and first.previous_response_id is None
    second = client.responses.create(previous_response_id=first.id, input="What is my name?", **kw)
    assert second.previous_response_id == first.id
    # the same as sending the whole conversation: the first turn's input and output, then the new input (the
    # instructions are not carried, as OpenAI's)
    history = [{"role": "user", "content": "My name is Ada. Say hello."}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history += [{"role": "user", "content": "What is my name?"}]
    whole = client.responses.create(input=history, store=False, **kw)
    assert whole.output_text == second.output_text and whole.usage.input_tokens == second.usage.input_tokens
    # streamed, a third turn on the second
    events = list(client.responses.create(previous_response_id=second.id, input="Thanks.", stream=True, **kw))
    third = events[-1].response
    assert third.previous_response_id == second.id and third.usage.input_tokens > second.usage.input_tokens
    assert third.usage.input_tokens_details.cached_tokens >= 32  # the prefix cache holds the turns before
    assert client.responses.retrieve(third.id).output_text == third.output_text
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    # its own input items, newest first unless asked otherwise, a page at a time
    three = client.responses.create(
        input=[{"role": "user", "content": t} for t in ("One.", "Two.", "Three.")], **kw
    )
    listed = client.responses.input_items.list(three.id)
    assert [item.content[0].text for item in listed.data] == ["Three.", "Two.", "One."]
    assert len({item.id for item in listed.data}) == 3 and listed.first_id == listed.data[0].id
    page = client.responses.input_items.list(three.id, order="asc", limit=2)
    assert [item.content[0].text for item in page.data] == ["One.", "Two."] and page.has_more
    rest = client.responses.input_items.list(three.id, order="asc", after=page.last_id)
    assert [item.content[0].text for item in rest.data] == ["Three."] and not rest.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(second.id).data] == [
        "What is my name?"
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(three.id, limit=0)
    assert e.value.body["param"] == "limit"
    # deleted: gone, and so is every conversation that goes back to it
    client.responses.delete(first.id)
    for call in (
        lambda: client.responses.retrieve(first.id),
        lambda: client.responses.delete(first.id),
        lambda: client.responses.input_items.list(first.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(previous_response_id=third.id, input="Bye.", **kw)
    assert e.value.body["param"] == "previous_response_id" and first.id in e.value.body["message"]
    # a tool loop on stored responses: the call's output goes back by previous_response_id alone
    tools = dict(tools=[WEATHER_TOOL], model="smollm2", temperature=0, max_output_tokens=64)
    called = client.responses.create(
        input=ASK_WEATHER, tool_choice="required", parallel_tool_calls=False, **tools
    )
    (call,) = [item for item in called.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    answered = client.responses.create(previous_response_id=called.id, input=[output], **tools)
    assert answered.status in ("completed", "incomplete") and answered.output
    # store: false keeps nothing
    unkept = client.responses.create(input="hi", store=False, **kw)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_what_is_refused_is_a_400_naming_it(client):
    cases = [
        ({"conversation": "conv_123"}, "conversation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "telepathy"}]}, "tools.0"),
        ({"tools": [{"type": "namespace", "name": "n", "tools": [WEB_SEARCH]}]}, "tools.0.namespace.tools.0"),
        (
            {"tool_choice": {"type": "web_search_preview"}, "tools": [{"type": "web_search_preview"}]},
            "tool_choice",
        ),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        ({"tool_choice": {"type": "custom", "name": "get_time"}, "tools": [TIME_TOOL]}, "tool_choice"),
        (
            {"tool_choice": {"type": "function", "name": "get_time"}, "tools": [WEATHER_NAMESPACE]},
            "tool_choice",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TIME_TOOL]}, "tool_choice"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format",
        ),
        ({"max_output_tokens": 10**6}, "input"),  # the input and that many tokens do not fit
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": "smollm2", "input": "hi", **extra})
        assert e.value.body["param"].startswith(param), (extra, e.value.body)
        for named in ("telepathy", "web_search_preview", "allowed_tools", "input_image", "max_output_tokens"):
            assert named in e.value.body["message"] or named not in json.dumps(extra)
