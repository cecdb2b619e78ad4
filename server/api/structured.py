"""Structured outputs: what a request asks its output to look like (response_format, vLLM's structured_outputs,
forced tool calls), turned into one grammar the engine constrains sampling with."""

import json

from server.api import protocol as p
from server.api.errors import ApiError
from server.api.serving import ServingState
from server.api.tools import Function, Tools, output_grammar
from server.engine.request import GrammarSpec


def chat_tools(body: p.ChatCompletionRequest) -> Tools | None:
    """The request's tools and tool_choice, checked; None when it offers no tools."""
    choice = body.tool_choice
    name = choice.function.name if isinstance(choice, p.NamedToolChoice) else None
    functions = [
        Function(t.function.name, t.function.description, t.function.parameters or {"type": "object"})
        for t in body.tools or []
    ]
    return offered_tools(functions, name or choice or "auto", body.parallel_tool_calls)


def offered_tools(functions: list[Function], choice: str, parallel: bool) -> Tools | None:
    """The functions a request offers and its tool_choice (none | auto | required | a function's name),
    checked whatever the API; None when it offers none."""
    if not functions:
        if choice not in ("none", "auto"):
            raise ApiError(400, "tool_choice names a tool, but the request has no tools", param="tool_choice")
        return None
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be unique", param="tools")
    if choice not in ("none", "auto", "required") and choice not in names:
        raise ApiError(400, f"tool_choice: no tool is named {choice[:64]!r}", param="tool_choice")
    return Tools(functions, choice, parallel)


def requested_grammar(body: p.SamplingFields, tools: Tools | None) -> tuple[GrammarSpec, str] | None:
    """(the grammar the output must follow, the request field it comes from), or None for free text."""
    answer = body.response_format.output_schema() if body.response_format is not None else None
    so = body.structured_outputs
    if so is not None:
        if answer is not None:
            raise ApiError(
                400, "give response_format or structured_outputs, not both", param="structured_outputs"
            )
        if tools is not None and tools.active:
            why = "structured_outputs cannot be combined with tools; use response_format"
            raise ApiError(400, why, param="structured_outputs")
        return structured_outputs_spec(so), "structured_outputs"
    return answer_grammar(answer, "response_format", tools)


def answer_grammar(answer: dict | None, param: str, tools: Tools | None) -> tuple[GrammarSpec, str] | None:
    """The grammar of a reply that is JSON matching the schema `answer` (None: free text; `param` is the field
    it comes from) or calls of the tools, as tool_choice says; None when nothing constrains the reply."""
    if tools is not None and tools.active:
        lark = output_grammar(tools, answer)
        return (GrammarSpec("lark", lark), "tools") if lark is not None else None
    if answer is not None:
        return GrammarSpec("json_schema", json.dumps(answer)), param
    return None


def structured_outputs_spec(so: p.StructuredOutputs) -> GrammarSpec:
    if so.json_ is not None:
        schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
        return GrammarSpec("json_schema", schema)
    if so.regex is not None:
        return GrammarSpec("regex", so.regex)
    if so.choice is not None:
        return GrammarSpec("choice", json.dumps(so.choice))
    if so.grammar is not None:
        return GrammarSpec("grammar", so.grammar)
    return GrammarSpec("json_schema", json.dumps({"type": "object"}))


async def output_grammar_for(state: ServingState, body: p.SamplingFields, tools: Tools | None = None):
    """The compiled grammar the request's output must follow (for SamplingParams.grammar), or None; a grammar
    that cannot be used is a 400 naming the field it came from."""
    return await compiled(state, requested_grammar(body, tools))


async def compiled(state: ServingState, requested: tuple[GrammarSpec, str] | None):
    """The requested grammar compiled, or None; a 400 naming its field when it cannot be."""
    if requested is None:
        return None
    spec, param = requested
    try:
        return await state.engine.compile_grammar(spec)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
