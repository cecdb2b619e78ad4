"""Structured outputs of OpenAI's chat and completions: the tools and tool_choice of a chat request, and what a
request asks its output to look like (response_format, vLLM's structured_outputs, forced tool calls), turned
into one grammar the engine constrains sampling with."""

import json

from server.api.errors import ApiError
from server.api.openai import protocol as p
from server.api.schemas import grammar_ready
from server.api.serving import Serving
from server.api.structured import answer_grammar, chat_function, constrain, offered_tools
from server.api.tools import Tools
from server.engine.request import GrammarSpec, SamplingParams


def chat_tools(body: p.ChatCompletionRequest) -> Tools | None:
    """The request's tools and tool_choice, checked; None when it offers no tools."""
    choice = body.tool_choice
    name = choice.function.name if isinstance(choice, p.NamedToolChoice) else None
    functions = [chat_function(t) for t in body.tools or []]
    return offered_tools(functions, name or choice or "auto", body.parallel_tool_calls)


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
    strict = body.response_format is not None and body.response_format.strict
    return answer_grammar(answer, "response_format", tools, strict)


def structured_outputs_spec(so: p.StructuredOutputs) -> GrammarSpec:
    if so.json_ is not None:
        schema = so.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError:
                return GrammarSpec("json_schema", so.json_)  # the compile says what is wrong with it
        # vLLM's structured outputs have no strict: keywords no grammar holds are ignored
        return GrammarSpec("json_schema", json.dumps(grammar_ready(schema)), lenient=True)
    if so.regex is not None:
        return GrammarSpec("regex", so.regex)
    if so.choice is not None:
        return GrammarSpec("choice", json.dumps(so.choice))
    if so.grammar is not None:
        return GrammarSpec("grammar", so.grammar)
    return GrammarSpec("json_schema", json.dumps({"type": "object"}))


async def constrain_output(
    serving: Serving, params: SamplingParams, body: p.SamplingFields, tools: Tools | None = None
) -> None:
    """params.grammar: the grammar the request's output must follow, compiled, or None; a grammar that cannot be
    used is a 400 naming the field it came from (structured.constrain)."""
    await constrain(serving, params, requested_grammar(body, tools), tools)
