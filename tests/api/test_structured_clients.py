"""Structured outputs and tool calls through real clients (the official openai SDK, langchain-openai) against
a live server on the real default model. Whatever a 135M model makes of the question, the grammar guarantees
the shape: outputs parse and validate, calls name declared functions with valid arguments."""

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class City(BaseModel):
    name: str
    country: str
    # bounded: left open, a greedy 135M model writes digits until max_tokens (the grammar allows any integer)
    population: int = Field(ge=0, le=100_000_000)


class Weather(BaseModel):
    """Current weather in a city."""

    city: str
    unit: str


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(default_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe Paris as a city record."}],
        response_format=City,
        temperature=0,
        max_tokens=60,
    )
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City) and message.parsed.name  # the SDK validated it
    print("parse ->", message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, stream):
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action"]}, "maxItems": 3},
        },
        "required": ["title", "year", "genres"],
        "additionalProperties": False,
    }
    kw = dict(
        model="smollm2",
        messages=[{"role": "user", "content": "Recommend a film."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "film", "schema": schema, "strict": True},
        },
        temperature=0.7,
        seed=11,
        max_tokens=100,
    )
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_cut_short_by_max_tokens_is_length(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "List many colors."}],
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "colors",
                "schema": {"type": "array", "items": {"type": "string"}, "minItems": 4},
            },
        },
        temperature=0,
        max_tokens=5,
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].message.content.startswith("[")


def test_json_object_and_vllm_structured_outputs(client):
    r = client.completions.create(
        model="smollm2",
        prompt="A JSON object describing a dog:",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    cases = [
        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"regex": r"\d{3}-\d{4}"}, lambda t: len(t) == 8 and t[3] == "-" and (t[:3] + t[4:]).isdigit()),
        ({"grammar": 'root ::= "red" | "green" | "blue"'}, lambda t: t in ("red", "green", "blue")),
    ]
    for structured, check in cases:
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Answer briefly."}],
            max_tokens=20,
            temperature=0.8,
            seed=5,
            extra_body={"structured_outputs": structured},
        )
        assert check(r.choices[0].message.content), (structured, r.choices[0].message.content)


def test_a_bad_schema_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2",
            messages=ASK_WEATHER,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )
    assert e.value.body["param"] == "response_format"


def test_tool_loop_call_result_answer(client):
    messages = list(ASK_WEATHER)
    r = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    schema = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]["function"][
        "parameters"
    ]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    print("call ->", call.function.name, call.function.arguments)

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees Celsius and sunny"})
    answer = client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0, max_tokens=40
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    print("answer ->", answer.choices[0].message.content)


def test_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=60,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and "zone" in json.loads(call.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls"


def test_streamed_tool_calls_are_reassembled_by_the_sdk(client):
    deltas = []
    with client.chat.completions.stream(
        model="smollm2",
        messages=ASK_WEATHER,
        tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    ) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                deltas.append(event.arguments_delta)
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments, Weather)
    assert len(deltas) > 1 and "".join(deltas) == call.function.arguments  # streamed as generated
    assert final.choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_answers_in_words_or_calls(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Hello! How are you?"}],
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=30,
    )
    message = r.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather"


def test_langchain_structured_output_and_bind_tools(default_server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="smollm2", base_url=f"{default_server}/v1", api_key="unused", temperature=0, max_tokens=80
    )
    city = llm.with_structured_output(City).invoke("Describe Rome as a city record.")
    assert isinstance(city, City)
    print("langchain with_structured_output ->", city)

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="required").invoke("Weather in Oslo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
    print("langchain bind_tools ->", message.tool_calls)
