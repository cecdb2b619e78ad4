"""/v1/chat/completions: messages rendered through the chat template, n choices, logprobs in the chat shape,
tool calls (server/api/tools.py) and structured outputs (server/api/structured.py)."""

import time
import uuid
from dataclasses import dataclass, field

from server.api import protocol as p
from server.api.errors import ApiError
from server.api.serving import (
    Choice,
    Disconnected,
    Event,
    OpenAIShape,
    ServingState,
    answer,
    check_model,
    check_queue,
    new_choices,
    rest_of_context,
    sampling_params,
    usage,
)
from server.api.structured import chat_tools, output_grammar_for
from server.api.tools import CallDelta, ToolCallParser, Tools, call_parser, render_history
from server.engine.request import RequestOutput, TokenLogprob


async def chat(state: ServingState, body: p.ChatCompletionRequest, log_id: str, disconnected: Disconnected):
    """A ChatCompletionResponse, an SSE stream of strings, or None when the client went away."""
    check_model(state, body.model)
    check_queue(state)
    tools = chat_tools(body)
    ids = chat_prompt_ids(state, body.messages, tools=tools)
    max_tokens = body.max_completion_tokens or body.max_tokens or rest_of_context(state, ids, "messages")
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    params.grammar = await output_grammar_for(state, body, tools)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = new_choices(state, response_id, 0, ids, params, body.n)
    shape = ChatShape(state, body, response_id, int(time.time()), tools)
    return await answer(state, choices, shape, log_id, disconnected, body.stream)


def chat_prompt_ids(
    state: ServingState,
    messages: list[p.ChatMessage] | list[dict],
    add_generation_prompt: bool = True,
    tools: Tools | None = None,
) -> list[int]:
    """The prompt the chat template makes of the messages (OpenAI's chat shape) and the tools offered, after the
    server's system prompt if they have none."""
    dicts = [m.model_dump(exclude_none=True) if isinstance(m, p.ChatMessage) else dict(m) for m in messages]
    for m in dicts:
        if m["role"] == "developer":
            m["role"] = "system"
    if state.system_prompt and not any(m["role"] == "system" for m in dicts):
        dicts.insert(0, {"role": "system", "content": state.system_prompt})
    tokenizer = state.engine.tokenizer
    native = tokenizer.template_renders_tools
    dicts = render_history(dicts, tools, native)
    if not tokenizer.template_renders_inline_system:
        dicts = fold_inline_system(dicts)
    try:
        # The template writes the special tokens (BOS, role markers) itself.
        template_tools = tools.template_tools() if tools is not None and native else None
        return tokenizer.encode(tokenizer.apply_chat_template(dicts, add_generation_prompt, template_tools))
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None


def fold_inline_system(messages: list[dict]) -> list[dict]:
    """The conversation for a template that cannot render a system message after the first turns (it refuses one
    or leaves it out): the system messages that lead are joined into one, and each later one joins a user turn,
    the one it follows when nothing came between, else the next (a user turn of its own when none follows).

    Not into the system prompt: Claude Code adds its reminders as it goes, and each would change the prompt's
    first tokens, so no request could reuse the last one's cached prefix; joined to a user turn, only the end of
    the prompt changes (vLLM folds them the same way, and Claude Code writes its own reminders into user turns)."""
    out: list[dict] = []
    pending: list = []  # the contents of system messages waiting for the next user turn
    for m in messages:
        if m["role"] != "system":
            if pending and m["role"] == "user":
                m, pending = {**m, "content": _joined(*pending, m.get("content"))}, []
            out.append(m)
        elif all(o["role"] == "system" for o in out):
            out[:] = [{**m, "content": _joined(*(o.get("content") for o in out), m.get("content"))}]
        elif out[-1]["role"] == "user" and not pending:
            out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), m.get("content"))}
        else:
            pending.append(m.get("content"))
    if pending:
        out.append({"role": "user", "content": _joined(*pending)})
    return out


def _joined(*contents: str | list | None) -> list[dict]:
    # As text parts, which the template renderer joins with newlines; a part it cannot render stays to be refused.
    return [p for c in contents for p in (c if isinstance(c, list) else [{"type": "text", "text": c or ""}])]


@dataclass
class ChatShape(OpenAIShape):
    state: ServingState
    body: p.ChatCompletionRequest
    response_id: str
    created: int
    tools: Tools | None = None
    parsers: dict[int, ToolCallParser] = field(default_factory=dict)  # by choice, while tools are offered

    def events(self, c: Choice, out: RequestOutput) -> list[Event]:
        d = self._delta(c, out)
        return [] if d is None else [Event(self.chunk([d]))]

    def _delta(self, c: Choice, out: RequestOutput) -> p.ChatChunkChoice | None:
        logprobs = None
        if self.body.logprobs:
            logprobs = p.ChatLogprobs(content=[self._logprob(e) for e in out.logprobs or []])
        text, calls, finish_reason = out.text, [], c.finish_reason
        if self.tools is not None and self.tools.active:
            parser = self.parsers.get(c.index)
            if parser is None:
                parser = self.parsers[c.index] = call_parser(self.tools)
            text, calls = parser.feed(out.text, final=out.finished)
            if finish_reason == "stop" and parser.num_calls:
                finish_reason = "tool_calls"
        if not text and not calls and not (logprobs and logprobs.content) and not out.finished:
            return None
        if calls:  # as OpenAI's: a delta of calls has no content unless there is text
            content = text or None
        else:
            content = text if text or not out.finished else None
        delta = p.DeltaMessage(content=content, tool_calls=tool_call_deltas(calls) or None)
        return p.ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)

    def _logprob(self, entry: TokenLogprob) -> p.TokenLogprob:
        tokenizer = self.state.engine.tokenizer

        def top(token_id: int, logprob: float) -> p.TopLogprob:
            return p.TopLogprob(
                token=tokenizer.token_text(token_id),
                logprob=logprob,
                bytes=list(tokenizer.token_bytes(token_id)),
            )

        chosen = top(entry.token_id, entry.logprob)
        return p.TokenLogprob(**chosen.model_dump(), top_logprobs=[top(t, lp) for t, lp in entry.top])

    def opening(self, choices: list[Choice]) -> list[Event]:
        # OpenAI's streams open each choice with its role and empty content.
        delta = p.DeltaMessage(role="assistant", content="")
        return [Event(self.chunk([p.ChatChunkChoice(index=c.index, delta=delta)])) for c in choices]

    def chunk(self, choices: list[p.ChatChunkChoice], usage: p.Usage | None = None):
        return p.ChatCompletionStreamResponse(
            id=self.response_id,
            created=self.created,
            model=self.state.model_name,
            choices=choices,
            usage=usage,
        )

    def empty(self, choices: list[Choice]) -> list[p.ChatChoice]:
        return [
            p.ChatChoice(
                index=c.index,
                message=p.AssistantMessage(content=""),
                logprobs=p.ChatLogprobs(content=[]) if self.body.logprobs else None,
            )
            for c in choices
        ]

    def add_choice(self, total: p.ChatChoice, delta: p.ChatChunkChoice) -> None:
        message = total.message
        message.content += delta.delta.content or ""
        for d in delta.delta.tool_calls or []:
            if message.tool_calls is None:
                message.tool_calls = []
            if d.index == len(message.tool_calls):
                function = p.FunctionCall(name=d.function.name, arguments=d.function.arguments or "")
                message.tool_calls.append(p.ToolCall(id=d.id, function=function))
            else:
                message.tool_calls[d.index].function.arguments += d.function.arguments or ""
        if total.logprobs is not None and delta.logprobs is not None:
            total.logprobs.content.extend(delta.logprobs.content)
        total.finish_reason = delta.finish_reason

    def response(self, answer: list[p.ChatChoice], choices: list[Choice]) -> p.ChatCompletionResponse:
        for choice in answer:  # a reply of calls alone has no content, as OpenAI's
            if choice.message.tool_calls and not choice.message.content:
                choice.message.content = None
        return p.ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.state.model_name,
            choices=answer,
            usage=usage(choices),
        )


def tool_call_deltas(calls: list[CallDelta]) -> list[p.ToolCallDelta]:
    """The parser's pieces in OpenAI's delta shape, one entry per call (pieces of one call joined)."""
    out: list[p.ToolCallDelta] = []
    for c in calls:
        if out and out[-1].index == c.index:
            out[-1].function.arguments = (out[-1].function.arguments or "") + c.arguments
            continue
        function = p.FunctionCallDelta(name=c.name, arguments=c.arguments)
        out.append(
            p.ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None, function=function)
        )
    return out
