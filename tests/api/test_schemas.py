"""The schemas a reply must match are closed to keys they do not list, and read in today's form
(server/api/schemas.py), in the grammars every API builds: response_format, tools' parameters (a tool without
them takes {}), vLLM's structured_outputs."""

import json

import pytest

from server.api.anthropic import protocol as mp
from server.api.anthropic.messages import request_tools
from server.api.errors import ApiError
from server.api.openai import protocol as p
from server.api.openai import responses_protocol as rp
from server.api.openai.responses import offered_functions
from server.api.openai.structured import chat_tools, requested_grammar
from server.api.schemas import grammar_ready
from server.api.structured import answer_grammar, offered_tools
from server.api.tools import Function
from server.engine.config import EngineConfig
from server.engine.engine import Engine

pytestmark = pytest.mark.timeout(60)

CAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


def test_objects_that_list_their_properties_are_closed_wherever_they_are():
    schema = {
        **CAT,
        "properties": {
            "owner": {"type": "object", "properties": {"id": {"type": "integer"}}},
            "toys": {"type": "array", "items": {"$ref": "#/$defs/toy"}},
            "either": {"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]},
        },
        "$defs": {"toy": {"type": "object", "properties": {"kind": {"type": "string"}}}},
    }
    closed = grammar_ready(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["owner"]["additionalProperties"] is False
    assert closed["$defs"]["toy"]["additionalProperties"] is False
    assert closed["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is left as it came


def test_what_a_schema_says_of_other_keys_is_kept():
    for said in (
        {"additionalProperties": True},
        {"additionalProperties": {"type": "integer"}},
        {"patternProperties": {"^x_": {}}},
        {"unevaluatedProperties": False},
    ):
        closed = grammar_ready({**CAT, **said})
        assert {k: closed[k] for k in said} == said and ("additionalProperties" in said) == (
            "additionalProperties" in closed
        )
    assert grammar_ready({"type": "object"}) == {"type": "object"}  # any object: nothing listed


def test_an_all_of_and_what_it_refers_to_stay_open():
    schema = {
        "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"extra": {"type": "string"}}}],
        "properties": {"id": {"type": "integer"}},
        "$defs": {"base": {"properties": {"name": {"type": "string"}}}, "other": {"properties": {"x": {}}}},
    }
    closed = grammar_ready(schema)
    assert "additionalProperties" not in closed
    assert "additionalProperties" not in closed["allOf"][1]
    assert "additionalProperties" not in closed["$defs"]["base"]
    assert closed["$defs"]["other"]["additionalProperties"] is False


def test_a_schema_deeper_than_python_recurses_comes_back_as_it_was():
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    assert grammar_ready(deep) is deep


def test_draft_04_boolean_bounds_are_read_as_today_s():
    schema = {
        "type": "object",
        "properties": {
            "above": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
            "below": {"type": "integer", "maximum": 10, "exclusiveMaximum": True, "minimum": 1},
            "inclusive": {"type": "number", "minimum": 2, "exclusiveMinimum": False},
            "today": {"type": "number", "exclusiveMinimum": 3},
        },
    }
    ready = grammar_ready(schema)["properties"]
    assert ready["above"] == {"type": "number", "exclusiveMinimum": 0}
    assert ready["below"] == {"type": "integer", "exclusiveMaximum": 10, "minimum": 1}
    assert ready["inclusive"] == {"type": "number", "minimum": 2}
    assert ready["today"] == schema["properties"]["today"]
    assert schema["properties"]["above"]["exclusiveMinimum"] is True  # the request's own is left as it came


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(str(tiny_llama_dir), EngineConfig(kv_cache_memory=4 << 20, block_size=4))


def accepts(engine: Engine, spec, text: str) -> bool:
    """Whether the grammar takes the whole of `text`."""
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return engine.grammars.compile(spec).new_state().valid_prefix(ids) == len(ids)


def test_a_reply_holds_only_the_keys_its_schema_lists(engine):
    spec, _ = answer_grammar(CAT, "response_format", None)
    assert accepts(engine, spec, '{"name": "Tom", "age": 3}')
    assert not accepts(engine, spec, '{"name": "Tom", "age": 3, "color": "orange"}')
    spec, _ = answer_grammar({**CAT, "additionalProperties": True}, "response_format", None)
    assert accepts(engine, spec, '{"name": "Tom", "age": 3, "color": "orange"}')
    # vLLM's structured_outputs, its schema as a string
    body = p.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"json": json.dumps(CAT)}}
    )
    spec, _ = requested_grammar(body, None)
    assert not accepts(engine, spec, '{"name": "Tom", "color": "orange"}')


def test_a_tools_arguments_hold_only_its_parameters_and_none_without_them(engine):
    body = p.ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": "required",
            "tools": [
                {"type": "function", "function": {"name": "now"}},
                {"type": "function", "function": {"name": "pet", "parameters": CAT}},
            ],
        }
    )
    spec, _ = requested_grammar(body, chat_tools(body))

    def call(name: str, arguments: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'

    assert accepts(engine, spec, call("now", "{}"))
    assert not accepts(engine, spec, call("now", '{"an argument": "time"}'))
    assert accepts(engine, spec, call("pet", '{"name": "Tom"}'))
    assert not accepts(engine, spec, call("pet", '{"name": "Tom", "kind": "cat"}'))


def test_a_tool_whose_parameters_are_not_an_object_is_refused():
    with pytest.raises(ApiError) as e:
        offered_tools([Function("f", None, {"type": "string"})], "auto", True)
    assert e.value.status == 400 and e.value.param == "tools" and "object" in e.value.message
    assert offered_tools([Function("f", None, {"type": ["object", "null"]})], "auto", True) is not None


@pytest.mark.parametrize("defs", ["$defs", "definitions"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_a_tools_own_refs_resolve_in_its_parameters(engine, defs, choice):
    """Pydantic and MCP tools write enums and nested models as "#/$defs/..." refs: a forced call resolves them in
    the tool's parameters, not in the grammar's call object around them."""
    weather = {
        "type": "object",
        defs: {"Unit": {"type": "string", "enum": ["c", "f"]}},
        "properties": {"city": {"type": "string"}, "unit": {"$ref": f"#/{defs}/Unit"}},
        "required": ["city", "unit"],
    }
    body = p.ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": choice,
            "tools": [
                {"type": "function", "function": {"name": "weather", "parameters": weather}},
                {"type": "function", "function": {"name": "now"}},
            ],
        }
    )
    spec, _ = requested_grammar(body, chat_tools(body))
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "unit": "%s"}}\n</tool_call>'
    assert accepts(engine, spec, call % "c")
    assert not accepts(engine, spec, call % "k")


def test_a_tool_schema_that_does_not_compile_is_refused_in_a_line_of_its_own(engine):
    broken = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    tools = offered_tools([Function("f", None, broken)], "required", True)
    spec, param = answer_grammar(None, "response_format", tools)
    with pytest.raises(ValueError) as e:
        engine.grammars.compile(spec)
    assert param == "tools" and "missing" in str(e.value)
    assert "<tool_call>" not in str(e.value) and "start:" not in str(
        e.value
    )  # not kvserve's grammar around it


def test_a_draft_04_exclusive_bound_holds_in_the_grammar(engine):
    strict = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "exclusiveMinimum": True}},
    }
    spec, _ = answer_grammar(strict, "response_format", None, strict=True)
    assert accepts(engine, spec, '{"n": 1}')
    assert not accepts(engine, spec, '{"n": 0}')


TAGS = {  # a Pydantic model's set[str] field: uniqueItems, which no grammar can hold
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    "required": ["tags"],
}


def test_keywords_no_grammar_holds_are_ignored_unless_the_schema_is_strict(engine):
    """OpenAI constrains a schema not marked strict not at all: kvserve holds it to every keyword it can and
    ignores the rest; a strict one, in every API that has the flag, is refused by the compile (a 400)."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for strict in (None, False, True):
        json_schema = {"name": "t", "schema": TAGS} | ({} if strict is None else {"strict": strict})
        body = p.ChatCompletionRequest.model_validate(
            {**chat, "response_format": {"type": "json_schema", "json_schema": json_schema}}
        )
        spec, param = requested_grammar(body, None)
        function = {"name": "f", "parameters": TAGS} | ({} if strict is None else {"strict": strict})
        body = p.ChatCompletionRequest.model_validate(
            {**chat, "tool_choice": "required", "tools": [{"type": "function", "function": function}]}
        )
        call_spec, call_param = requested_grammar(body, chat_tools(body))
        responses = rp.ResponsesRequest.model_validate(
            {"input": "hi", "tools": [{"type": "function", **function}], "tool_choice": "required"}
        )
        functions, _ = offered_functions(responses)
        response_spec, _ = answer_grammar(None, "text.format", offered_tools(functions, "required", True))
        assert (param, call_param) == ("response_format", "tools")
        for s in (spec, call_spec, response_spec):
            assert s.lenient == (not strict)
            if strict:
                with pytest.raises(ValueError, match="uniqueItems"):
                    engine.grammars.compile(s)
        if not strict:  # the rest of the schema holds
            assert accepts(engine, spec, '{"tags": ["a", "b"]}')
            assert not accepts(engine, spec, '{"tags": ["a", 1]}')
            assert not accepts(engine, spec, '{"tags": ["a"], "more": 1}')
            assert accepts(
                engine, call_spec, '<tool_call>\n{"name": "f", "arguments": {"tags": []}}\n</tool_call>'
            )
    # vLLM's structured_outputs has no strict: lenient; Anthropic's output format is always strict, its tools
    # as they say
    body = p.ChatCompletionRequest.model_validate({**chat, "structured_outputs": {"json": TAGS}})
    assert requested_grammar(body, None)[0].lenient
    messages = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}
    for strict in (False, True):
        tool = {"name": "f", "input_schema": TAGS, "strict": strict}
        body = mp.MessagesRequest.model_validate(
            {**messages, "tools": [tool], "tool_choice": {"type": "any"}}
        )
        spec, _ = answer_grammar(None, "output_config.format", request_tools(body))
        assert spec.lenient == (not strict)
