"""Structured outputs whatever the API: the tools a request offers and its tool_choice, checked, and the one
grammar the engine constrains sampling with when the reply must be JSON matching a schema or calls of the tools.
What each API's fields ask for is read in its own module (OpenAI's chat and completions: openai/structured.py)."""

import asyncio

from server.api import protocol as p
from server.api.errors import ApiError
from server.api.serving import Serving
from server.api.tools import NO_PARAMETERS, Function, Tools, output_grammar
from server.engine.request import GrammarSpec, SamplingParams


def chat_function(tool: p.ChatTool) -> Function:
    """A tool as OpenAI's chat declares it."""
    f = tool.function
    return Function(f.name, f.description, f.parameters or NO_PARAMETERS, bool(f.strict))


def offered_tools(functions: list[Function], choice: str, parallel: bool) -> Tools | None:
    """The functions a request offers and its tool_choice (none | auto | required | a function's name),
    checked whatever the API; None when it offers none."""
    if not functions:
        if choice == "required":
            raise ApiError(
                400, "tool_choice asks for a tool call, but the request has no tools", param="tool_choice"
            )
        if choice not in ("none", "auto"):
            raise ApiError(400, "tool_choice names a tool, but the request has no tools", param="tool_choice")
        return None
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be unique", param="tools")
    for f in functions:  # a call's arguments are an object
        kind = f.parameters.get("type", "object")
        if "object" not in (kind if isinstance(kind, list) else [kind]):
            why = f"tools: {f.name[:64]}'s parameters must be an object's schema (type object), not {str(kind)[:64]}"
            raise ApiError(400, why, param="tools")
    if choice not in ("none", "auto", "required") and choice not in names:
        raise ApiError(400, f"tool_choice: no tool is named {choice[:64]!r}", param="tool_choice")
    return Tools(functions, choice, parallel)


def answer_grammar(
    answer: dict | None, param: str, tools: Tools | None, strict: bool = False
) -> tuple[GrammarSpec, str] | None:
    """The grammar of a reply that is JSON matching the schema `answer` (None: free text; `param` is the field
    it comes from; strict: the client asked that it match whole) or calls of the tools, as tool_choice says;
    None when nothing constrains the reply."""
    spec = output_grammar(tools, answer, strict)
    if spec is None:
        return None
    return spec, "tools" if tools is not None and tools.active else param


async def constrain(
    serving: Serving, params: SamplingParams, requested: tuple[GrammarSpec, str] | None, tools: Tools | None
) -> None:
    """Constrain the reply as requested (answer_grammar's answer): params.grammar compiled, or a 400 naming its
    field. The tools' schemas are checked even when no grammar holds the calls (tool_choice auto or none): a
    tool whose parameters no grammar can be built from is a 400 whatever tool_choice says, as OpenAI's."""
    if requested is None:
        if tools is None or not tools.functions:
            return
        # each as its own strict says; built off the event loop (an agent's 40 tools take ~2 ms)
        calls = await asyncio.to_thread(
            lambda: [output_grammar(Tools([f], "required"), None) for f in tools.functions]
        )
        for f, spec in zip(tools.functions, calls, strict=True):
            try:
                await serving.engine.check_grammar(spec, serving.received)
            except ValueError as e:
                raise ApiError(400, f"tools: {f.name[:64]}'s parameters: {e}", param="tools") from None
        return
    spec, param = requested
    try:
        params.grammar = await serving.engine.compile_grammar(spec, serving.received)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    serving.grammar_param = param
