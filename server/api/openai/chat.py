"""/v1/chat/completions: messages rendered through the chat template (server/api/prompt.py), n choices,
logprobs in the chat shape, reasoning apart from the answer (server/api/reasoning.py), tool calls
(server/api/tools.py) and structured outputs (server/api/structured.py)."""

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from server.api.openai import protocol as p
from server.api.openai.shape import OpenAIShape, token_logprob
from server.api.openai.structured import chat_tools, constrain_output
from server.api.prompt import chat_prompt, template_kwargs
from server.api.reasoning import ReplyParser, reason, reply_parser
from server.api.serving import Serving
from server.api.shape import Choice, Event
from server.api.tools import CallDelta, Tools, call_parser
from server.engine.request import RequestOutput


async def chat(serving: Serving, body: p.ChatCompletionRequest):
    """A ChatCompletionResponse, an SSE stream of strings, or None when the client went away."""
    serving.check_model(body.model)
    serving.check_queue(body.n)
    tools = chat_tools(body)
    kwargs = template_kwargs(body.chat_template_kwargs, body.reasoning_effort)
    # off the event loop: a 4 MB conversation takes ~2 s to render and tokenize, every other stream's meanwhile
    prompt = await asyncio.to_thread(
        chat_prompt,
        serving,
        body.messages,
        body.add_generation_prompt,
        tools,
        kwargs,
        body.continue_final_message,
    )
    ids = prompt.ids
    max_tokens = body.max_completion_tokens or body.max_tokens or serving.rest_of_context(ids, "messages")
    params = serving.sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    await constrain_output(serving, params, body, tools)
    reason(params, serving.reasoning, prompt.reasoning_start)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    names = {"prompt": "messages"} | (
        {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens else {}
    )
    choices = serving.choices(response_id, 0, ids, params, body.n, names=names)
    shape = ChatShape(serving, body, response_id, int(time.time()), tools, prompt.reasoning_start)
    return await serving.answer(choices, shape, body.stream)


@dataclass
class ChatShape(OpenAIShape):
    body: p.ChatCompletionRequest
    tools: Tools | None = None
    reasoning_start: str = "out"  # where each reply starts against the reasoning (prompt.Prompt)
    parsers: dict[int, ReplyParser] = field(default_factory=dict)  # by choice
    chunk_type = p.ChatCompletionStreamResponse
    response_type = p.ChatCompletionResponse

    def delta(self, c: Choice, out: RequestOutput) -> p.ChatChunkChoice | None:
        logprobs = None
        if self.body.logprobs:
            logprobs = p.ChatLogprobs(content=[token_logprob(self.serving, e) for e in out.logprobs or []])
        finish_reason = c.finish_reason
        parser = self.parsers.get(c.index)
        if parser is None:
            calls_parser = call_parser(self.tools)
            parser = reply_parser(self.serving.reasoning, self.reasoning_start, self.tools, calls_parser)
            self.parsers[c.index] = parser
        pieces = parser.feed(out)
        c.num_reasoning_tokens = parser.num_reasoning_tokens
        text = "".join(piece.text for piece in pieces if piece.kind == "content")
        reasoning = "".join(piece.text for piece in pieces if piece.kind == "reasoning")
        reasoning = reasoning if self.body.include_reasoning else ""
        calls = [piece.call for piece in pieces if piece.kind == "call"]
        if finish_reason == "stop" and parser.num_calls:
            finish_reason = "tool_calls"
        if not (text or reasoning or calls or (logprobs and logprobs.content) or out.finished):
            return None
        if calls or reasoning:  # as OpenAI's: a delta of calls has no content unless there is text
            content = text or None
        else:
            content = text if text or not out.finished else None
        delta = p.DeltaMessage(
            content=content,
            reasoning_content=reasoning or None,
            reasoning=reasoning or None,
            tool_calls=tool_call_deltas(calls) or None,
        )
        return p.ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)

    def opening(self, choices: list[Choice]) -> list[Event]:
        # OpenAI's streams open each choice with its role and empty content.
        delta = p.DeltaMessage(role="assistant", content="")
        return [
            Event(self.chunk([p.ChatChunkChoice(index=c.index, delta=delta)], self.usage_so_far(c)))
            for c in choices
        ]

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
        if delta.delta.reasoning_content:
            message.reasoning_content = (message.reasoning_content or "") + delta.delta.reasoning_content
            message.reasoning = message.reasoning_content
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
        return super().response(answer, choices)


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
