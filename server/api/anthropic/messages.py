"""/v1/messages, Anthropic's Messages API: the system prompt and messages (text, tool_use and tool_result blocks)
become chat messages rendered through the chat template as /v1/chat/completions renders them, and the reply
streams as content blocks (thinking, text, tool_use) in Anthropic's event sequence."""

import asyncio
import functools
import hashlib
import json
import logging
import uuid
from dataclasses import dataclass, field

from server.api.anthropic import protocol as mp
from server.api.blocks import Closed, Grew, Opened, ReplyBlocks, Step
from server.api.errors import ApiError
from server.api.prompt import Prompt, chat_prompt
from server.api.reasoning import check_budget, reason, reply_parser
from server.api.serving import Serving
from server.api.shape import Choice, Event, Shape, usage
from server.api.structured import answer_grammar, constrain, offered_tools
from server.api.tools import Function, Tools, call_parser, new_call_id

log = logging.getLogger(__name__)

CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice types -> kvserve's
ENGINE_NAMES = {"prompt": "messages", "stop": "stop_sequences"}  # the engine's field names, here
SHUT_DOWN = "the server shut down before the message was finished"
# Claude Code opens its system prompt with this attribution line for Anthropic's billing, and it changes with the
# conversation's first message (cc_version=2.1.200.209, then .b31): left out of the prompt (vLLM drops it too), so
# that conversations share the prompt's first tokens, and with them the prefix cache.
BILLING_HEADER = "x-anthropic-billing-header:"


async def message(serving: Serving, body: mp.MessagesRequest):
    """A MessageResponse, an SSE stream of strings, or None when the client went away."""
    serving.check_model(body.model)
    serving.check_queue()
    tools = request_tools(body)
    if unused := body.unused_fields():
        log.debug("request %s: accepted, not used: %s", serving.request_id, ", ".join(unused))
    thinking = thinks(body)
    budget = body.thinking.budget_tokens if thinking else None
    if budget is not None:
        check_budget(budget, "thinking.budget_tokens")
    if thinking and prefills(body):
        raise ApiError(400, "a final assistant message (a prefill) cannot be continued with thinking enabled",
                       param="messages")  # fmt: skip
    prompt = await asyncio.to_thread(render, serving, body, tools)  # off the event loop, as chat's
    ids = prompt.ids
    # Clients written for large models ask for more than a small context holds: generate what fits, and say
    # so by the stop reason (model_context_window_exceeded), as Anthropic's API does.
    max_tokens = min(body.max_tokens, rest_of_context(serving, ids))
    params = serving.sampling_params(body, max_tokens, None)
    schema = body.output_config.format.schema_ if body.output_config and body.output_config.format else None
    # Anthropic's structured outputs always match the schema whole: strict
    await constrain(
        serving, params, answer_grammar(schema, "output_config.format", tools, strict=True), tools
    )
    reason(params, serving.reasoning, prompt.reasoning_start, budget)
    message_id = f"msg_{uuid.uuid4().hex}"
    choices = serving.choices(message_id, 0, ids, params, names=ENGINE_NAMES)
    new_id = functools.partial(new_call_id, "toolu_")
    parser = reply_parser(
        serving.reasoning, prompt.reasoning_start, tools, call_parser(tools, new_id), new_id
    )
    shape = MessagesShape(serving, body, message_id, ReplyBlocks(parser), thinking)
    return await serving.answer(choices, shape, body.stream)


def render(serving: Serving, body: mp.MessagesRequest, tools: Tools | None) -> Prompt:
    """The request's prompt: its conversation and tools through the chat template, as its thinking asks, and a
    final assistant message continued (a prefill)."""
    messages = chat_messages(body)
    kwargs = thinking_kwargs(body)
    return chat_prompt(
        serving, messages, tools=tools, template_kwargs=kwargs, continue_final_message=prefills(body)
    )


def thinks(body: mp.MessagesRequest) -> bool:
    """The request enables thinking: its blocks are shown."""
    return body.thinking is not None and body.thinking.type != "disabled"


def rest_of_context(serving: Serving, ids: list[int]) -> int:
    """How many tokens may follow the prompt. One that leaves no room is refused in Anthropic's words, which
    clients (Claude Code) read to compact the conversation."""
    try:
        return serving.rest_of_context(ids, "messages")
    except ApiError as e:
        why = f"prompt is too long: {len(ids)} tokens > {serving.engine.max_model_len - 1} maximum"
        raise ApiError(400, why, param=e.param, code=e.code) from None


def thinking_kwargs(body: mp.MessagesRequest) -> dict | None:
    """The template variables of the request's thinking: Anthropic's models think only when asked, and so are
    the templates that can leave the thinking out (Qwen3's enable_thinking)."""
    return None if thinks(body) else {"enable_thinking": False}


def request_tools(body: mp.MessagesRequest) -> Tools | None:
    functions = [Function(t.name, t.description, t.input_schema, bool(t.strict)) for t in body.tools]
    choice = body.tool_choice
    parallel = not choice.disable_parallel_tool_use
    return offered_tools(functions, choice.name if choice.type == "tool" else CHOICES[choice.type], parallel)


def chat_messages(body: mp.MessagesRequest) -> list[dict]:
    """The conversation in the chat shape chat_prompt_ids() renders: the system blocks (but Claude Code's billing
    line) as the system message, an assistant's tool_use blocks as its tool_calls and its thinking blocks as its
    reasoning_content, a user's tool_result blocks as tool messages (before its text, as Anthropic has them
    first), and a system message among the others as a
    system message where it stands (chat_prompt_ids() folds it into a user turn for a template that cannot
    render it there)."""
    messages: list[dict] = []
    system = [b.text for b in body.system if not b.text.startswith(BILLING_HEADER)]
    if system:
        messages.append({"role": "system", "content": "\n".join(system)})
    call_ids = set()
    for i, m in enumerate(body.messages):
        texts, calls, thoughts = [], [], []
        for block in m.content:
            match block:
                case mp.TextBlock():
                    texts.append(block.text)
                case mp.ThinkingBlock() if m.role == "assistant":
                    thoughts.append(block.thinking)
                case mp.RedactedThinkingBlock() if m.role == "assistant":
                    pass
                case mp.ToolUseBlock() if m.role == "assistant":
                    function = {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}
                    calls.append({"id": block.id, "type": "function", "function": function})
                    call_ids.add(block.id)
                case mp.ToolResultBlock() if m.role == "user":
                    if block.tool_use_id not in call_ids:
                        why = f"tool_result {block.tool_use_id[:64]!r} follows no tool_use of that id"
                        raise ApiError(400, f"messages.{i}: {why}", param=f"messages.{i}")
                    content = "\n".join(b.text for b in block.content)
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
                case _:
                    home = "user" if block.type == "tool_result" else "assistant"
                    why = f"{block.type} blocks belong in {home} messages"
                    raise ApiError(400, f"messages.{i}: {why}", param=f"messages.{i}")
        reasoning = {"reasoning_content": "\n".join(thoughts)} if thoughts else {}
        if calls:
            messages.append(
                {"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls, **reasoning}
            )
        elif texts or thoughts:
            messages.append({"role": m.role, "content": "\n".join(texts), **reasoning})
    final = (messages[-1].get("content") or "") if prefills(body) and messages else ""
    if final != final.rstrip():
        # Anthropic's rule (a prefill ending in a space would have the model write a token that starts with one)
        raise ApiError(400, "final assistant content cannot end with trailing whitespace", param="messages")
    return messages


def prefills(body: mp.MessagesRequest) -> bool:
    """The conversation ends with an assistant message: the start of the reply, which the model continues."""
    return body.messages[-1].role == "assistant"


@dataclass
class Reply:
    """A message as its events fold into it: a tool_use block's input is JSON text until the block stops."""

    message: mp.MessageResponse
    input_json: dict[int, str] = field(default_factory=dict)  # by block


@dataclass
class MessagesShape(Shape):
    """The reply as content blocks: a thinking block for each stretch of reasoning (when the request enables
    thinking; otherwise the reasoning is not shown), a text block for each stretch of text, a tool_use block for
    each call."""

    serving: Serving
    body: mp.MessagesRequest
    message_id: str
    blocks: ReplyBlocks
    thinking: bool = False  # the request enabled thinking: its blocks are shown
    index: dict[int, int] = field(default_factory=dict)  # reply block -> its index in the message
    started: bool = False  # message_start went out
    end = ""
    closes_with_answer = False  # message_delta carries the stop reason and usage only

    def opening(self, choices: list[Choice]) -> list[Event]:
        return []  # message_start goes with the first output, when the prefix cache's share of the input is known

    def events(self, c: Choice, out) -> list[Event]:
        start = []
        if not self.started:  # its usage as message_delta's will say: input_tokens apart from the cache's
            self.started = True
            message = self.empty([c]).message.model_copy(update={"usage": self._usage([c])})
            start = [named(mp.MessageStartEvent(message=message))]
        steps = self.blocks.feed(out)
        c.num_reasoning_tokens = self.blocks.num_reasoning_tokens
        return start + [named(e) for step in steps for e in self._events(step)]

    def _events(self, step: Step) -> list:
        block = step.block
        if block.reasoning and not self.thinking:
            return []
        if isinstance(step, Opened):  # blocks not shown take no index
            self.index[block.index] = len(self.index)
        index = self.index[block.index]
        match step:
            case Opened() if block.reasoning:
                thinking = mp.ThinkingBlock(thinking="", signature="")
                return [mp.ContentBlockStartEvent(index=index, content_block=thinking)]
            case Opened() if block.call is None:
                return [mp.ContentBlockStartEvent(index=index, content_block=mp.TextBlock(text=""))]
            case Opened():
                tool_use = mp.ToolUseBlock(id=block.call.id, name=block.call.name, input={})
                return [mp.ContentBlockStartEvent(index=index, content_block=tool_use)]
            case Grew(piece=piece) if block.reasoning:
                if self.body.thinking.display == "omitted":
                    return []
                return [mp.ContentBlockDeltaEvent(index=index, delta=mp.ThinkingDelta(thinking=piece))]
            case Grew(piece=piece) if block.call is None:
                return [mp.ContentBlockDeltaEvent(index=index, delta=mp.TextDelta(text=piece))]
            case Grew(piece=piece):
                return [mp.ContentBlockDeltaEvent(index=index, delta=mp.InputJsonDelta(partial_json=piece))]
            case Closed() if block.reasoning:
                signature = mp.SignatureDelta(signature=thinking_signature(block.text))
                return [
                    mp.ContentBlockDeltaEvent(index=index, delta=signature),
                    mp.ContentBlockStopEvent(index=index),
                ]
            case Closed():
                return [mp.ContentBlockStopEvent(index=index)]

    def closing(self, answer: Reply, choices: list[Choice]) -> list[Event]:
        (c,) = choices
        if c.finish_reason == "abort":  # only a shutdown ends a request that way and still answers
            return self.failed(ApiError(503, SHUT_DOWN, type="unavailable_error"))
        delta = mp.MessageDelta(stop_reason=self._stop_reason(c), stop_sequence=c.stop_string)
        return [
            named(mp.MessageDeltaEvent(delta=delta, usage=self._usage(choices))),
            named(mp.MessageStopEvent()),
        ]

    def _stop_reason(self, c: Choice) -> str:
        if c.finish_reason == "length":
            return (
                "max_tokens"
                if c.num_output_tokens >= self.body.max_tokens
                else "model_context_window_exceeded"
            )
        if c.stop_string is not None:
            return "stop_sequence"
        return "tool_use" if self.blocks.num_calls else "end_turn"

    @staticmethod
    def _usage(choices: list[Choice]) -> mp.MessageUsage:
        u = usage(choices)
        cached = u.prompt_tokens_details.cached_tokens
        return mp.MessageUsage(
            input_tokens=u.prompt_tokens - cached,
            output_tokens=u.completion_tokens,
            cache_read_input_tokens=cached,
        )

    def failed(self, error: ApiError) -> list[Event]:
        return [named(mp.error_body(error))]

    def empty(self, choices: list[Choice]) -> Reply:
        # before any output the cache is not yet looked up: the whole prompt counts as input
        first = mp.MessageUsage(input_tokens=len(choices[0].prompt_ids), output_tokens=0)
        return Reply(mp.MessageResponse(id=self.message_id, model=self.serving.model_name, usage=first))

    def add(self, answer: Reply, event) -> None:
        content = answer.message.content
        match event:
            case mp.ContentBlockStartEvent():
                content.append(event.content_block.model_copy(deep=True))
            case mp.ContentBlockDeltaEvent(delta=mp.TextDelta(text=text)):
                content[event.index].text += text
            case mp.ContentBlockDeltaEvent(delta=mp.ThinkingDelta(thinking=text)):
                content[event.index].thinking += text
            case mp.ContentBlockDeltaEvent(delta=mp.SignatureDelta(signature=signature)):
                content[event.index].signature = signature
            case mp.ContentBlockDeltaEvent(delta=mp.InputJsonDelta(partial_json=piece)):
                answer.input_json[event.index] = answer.input_json.get(event.index, "") + piece
            case mp.ContentBlockStopEvent() if event.index in answer.input_json:
                content[event.index].input = tool_input(answer.input_json.pop(event.index))
            case mp.MessageDeltaEvent():
                answer.message.stop_reason = event.delta.stop_reason
                answer.message.stop_sequence = event.delta.stop_sequence
                answer.message.usage = event.usage

    def response(self, answer: Reply, choices: list[Choice]) -> mp.MessageResponse:
        if choices[0].finish_reason == "abort":
            raise ApiError(503, SHUT_DOWN, type="unavailable_error")
        return answer.message


def named(data) -> Event:
    """An event under its type's name, as Anthropic's streams name them."""
    return Event(data, data.type)


def thinking_signature(thinking: str) -> str:
    """A thinking block's signature: Anthropic's is a proof the thinking is its model's, which clients send back
    untouched; kvserve checks nothing, so its own is a digest of the text."""
    return "kvserve-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def tool_input(text: str) -> dict:
    """A tool_use block's input from its JSON; {} when that is not an object (a call cut short by max_tokens,
    which Anthropic's clients retry with more)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
