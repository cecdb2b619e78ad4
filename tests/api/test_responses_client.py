"""/v1/responses through the official openai SDK (responses.create, responses.stream, responses.parse) against a
live server on the real default model: text, JSON-schema output, a tool loop, streaming, and what is refused.
Run with -s to see the streamed output."""

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.timeout(300)

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
        u.input_tokens_details.cached_tokens >= 0 and r.store is False and r.instructions == "You are terse."
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
    # the client sends the output back, with the call's result: stateless, the whole conversation each time
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
    print("final:", call.name, call.arguments)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3 and "".join(deltas) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments


def test_what_is_refused_is_a_400_naming_it(client):
    cases = [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
        (
            {"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1}]},
            "tools.0.type",
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
        for named in (
            "web_search",
            "file_search",
            "computer_use_preview",
            "input_image",
            "max_output_tokens",
        ):
            assert named in e.value.body["message"] or named not in json.dumps(extra)
