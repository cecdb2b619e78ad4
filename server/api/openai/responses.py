"""/v1/responses, OpenAI's Responses API: the input items (after those of the stored response it continues, if
any) become chat messages rendered through the chat template as /v1/chat/completions renders them, and the reply
streams as output items (the model's reasoning, a message's text, function calls, custom tool calls) in the
Responses event sequence; the finished response is stored unless asked not to be (openai/response_store.py).

The model is offered every tool as a function: a namespace tool's functions flattened out as
`<namespace>.<name>`, a custom tool as a function of one string argument, `input`. Its calls are mapped back to
what the request declared: `name` and `namespace` apart (Codex runs a namespaced call only so), and a custom
tool's `input` as the text it is. Built-in tools are left out of the prompt (see ignored_tools).
"""

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from server.api.blocks import Block, Closed, Grew, Opened, ReplyBlocks, Step
from server.api.errors import ApiError
from server.api.openai import responses_protocol as rp
from server.api.openai.protocol import TokenLogprob
from server.api.openai.response_store import ResponseStore
from server.api.openai.shape import token_logprob
from server.api.prompt import chat_prompt, template_kwargs
from server.api.reasoning import reason, reply_parser
from server.api.serving import Serving
from server.api.shape import Choice, Event, Shape, usage
from server.api.structured import answer_grammar, constrain, offered_tools
from server.api.tools import NO_PARAMETERS, Function, call_parser
from server.engine.request import RequestOutput

log = logging.getLogger(__name__)
ENGINE_NAMES = {"prompt": "input", "max_tokens": "max_output_tokens"}  # the engine's field names, here
SHUT_DOWN = "the server shut down before the response was finished"
IGNORED_TOOLS_HEADER = "x-kvserve-ignored-tools"
CUSTOM_INPUT = {  # a custom tool's one argument, as the model is offered it
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Offered:
    """A tool as the request declared it, behind the function the model is offered."""

    name: str
    namespace: str | None
    custom: bool


def prompt_name(name: str, namespace: str | None) -> str:
    """The name the model knows a tool by."""
    return f"{namespace}.{name}" if namespace else name


def offered_functions(body: rp.ResponsesRequest) -> tuple[list[Function], dict[str, Offered]]:
    """The functions the model is offered, and by their names the tools they stand for."""
    functions: list[Function] = []
    offered: dict[str, Offered] = {}
    for tool in body.tools:
        if isinstance(tool, rp.BuiltinTool):
            continue
        namespace = tool.name if isinstance(tool, rp.NamespaceTool) else None
        for t in tool.tools if isinstance(tool, rp.NamespaceTool) else [tool]:
            name = prompt_name(t.name, namespace)
            if isinstance(t, rp.CustomTool):
                functions.append(Function(name, custom_description(t), CUSTOM_INPUT))
            else:
                functions.append(Function(name, t.description, t.parameters or NO_PARAMETERS, bool(t.strict)))
            offered[name] = Offered(t.name, namespace, isinstance(t, rp.CustomTool))
    return functions, offered


def custom_description(tool: rp.CustomTool) -> str | None:
    """A custom tool's description, with its input's grammar: the model is shown it; nothing enforces it (the
    input is a JSON string inside the call, and the grammar is over the raw text)."""
    if tool.format.type == "text":
        return tool.description
    syntax, definition = tool.format.syntax, tool.format.definition
    grammar = f"Its input is text in the language of this {syntax} grammar:\n{definition}"
    return f"{tool.description}\n\n{grammar}" if tool.description else grammar


def custom_input(arguments: str) -> str:
    """A custom tool call's input, from the arguments the model wrote: {"input": "..."}, or a bare string; any
    other JSON (or none) is passed on as written."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return value if isinstance(value, str) else arguments


def ignored_tools(body: rp.ResponsesRequest) -> list[str]:
    """The types of the built-in tools the request offers, which kvserve leaves out of the prompt."""
    return list(dict.fromkeys(t.type for t in body.tools if isinstance(t, rp.BuiltinTool)))


def ignored_tools_header(body: rp.ResponsesRequest) -> dict[str, str]:
    """The response header that names them (none when there are none)."""
    ignored = ignored_tools(body)
    return {IGNORED_TOOLS_HEADER: ", ".join(ignored)} if ignored else {}


async def respond(serving: Serving, body: rp.ResponsesRequest, store: ResponseStore):
    """A ResponseObject, an SSE stream of strings, or None when the client went away. The response is kept in
    `store` when it finishes, unless the request says store: false."""
    serving.check_model(body.model)
    serving.check_queue()
    earlier = continued(store, body.previous_response_id)
    if ignored := ignored_tools(body):
        log.warning(
            "%s: built-in tools left out of the prompt (kvserve cannot run): %s", serving.request_id, ignored
        )
    functions, offered = offered_functions(body)
    choice = body.tool_choice
    if isinstance(choice, rp.NamedChoice):
        tool = offered.get(choice.prompt_name())
        if tool is not None and tool.custom != (choice.type == "custom"):
            kind, other = ("a custom tool", "function") if tool.custom else ("a function", "custom")
            why = f"tool_choice: {choice.prompt_name()[:130]!r} is {kind}, not of type {other!r}"
            raise ApiError(400, why, param="tool_choice")
        choice = choice.prompt_name()
    tools = offered_tools(functions, choice, body.parallel_tool_calls)
    effort = body.reasoning.effort if body.reasoning is not None else None
    kwargs = template_kwargs(body.chat_template_kwargs, effort)
    messages = chat_messages(body.instructions, earlier + body.input)
    prompt = await asyncio.to_thread(chat_prompt, serving, messages, tools=tools, template_kwargs=kwargs)
    ids = prompt.ids
    max_tokens = body.max_output_tokens or serving.rest_of_context(ids, "input")
    params = serving.sampling_params(body, max_tokens, body.logprobs)
    answer = body.text.format.output_schema()
    strict = bool(body.text.format.strict)
    await constrain(serving, params, answer_grammar(answer, "text.format", tools, strict), tools)
    reason(params, serving.reasoning, prompt.reasoning_start)
    response_id = f"resp_{uuid.uuid4().hex}"
    choices = serving.choices(response_id, 0, ids, params, names=ENGINE_NAMES)
    parser = reply_parser(serving.reasoning, prompt.reasoning_start, tools, call_parser(tools))
    blocks = ReplyBlocks(parser)
    kept = store if body.store and store.max_bytes > 0 else None
    shape = ResponsesShape(serving, body, response_id, int(time.time()), blocks, offered, kept)
    return await serving.answer(choices, shape, body.stream)


def continued(store: ResponseStore, response_id: str | None) -> list[rp.InputItem]:
    """The conversation of the stored response a request continues (none: [])."""
    if response_id is None:
        return []
    try:
        return store.conversation(response_id)
    except KeyError as e:
        missing = e.args[0]
        if missing == response_id:
            why = f"previous_response_id: no stored response {missing[:100]!r}"
        else:  # an earlier turn of its conversation is gone
            why = f"previous_response_id: {response_id[:100]!r} continues {missing[:100]!r}, no longer stored"
        why += " (responses are kept in the server's memory, within --responses-store-memory)"
        raise ApiError(404, why, param="previous_response_id", code="previous_response_not_found") from None


def chat_messages(instructions: str | None, items: list[rp.InputItem]) -> list[dict]:
    """The conversation in the chat shape chat_prompt_ids() renders: the instructions as the system message,
    function and custom tool calls as the tool_calls of the assistant message they follow (named as the model
    is offered them), their outputs as tool messages, reasoning items as the reasoning_content of the assistant
    message that follows them."""
    messages: list[dict] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    call_ids = set()
    reasoning: list[str] = []  # reasoning items waiting for the assistant message they come before

    def with_reasoning(message: dict) -> dict:
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return message

    for item in items:
        last = messages[-1] if messages else {}
        match item:
            case rp.ReasoningItem():
                reasoning.extend(p.text for p in item.content or item.summary)
            case rp.MessageItem():
                message = {"role": item.role, "content": "\n".join(p.text for p in item.content)}
                messages.append(with_reasoning(message) if item.role == "assistant" else message)
            case rp.FunctionCallItem() | rp.CustomToolCallItem():
                if isinstance(item, rp.FunctionCallItem):
                    arguments = item.arguments
                else:
                    arguments = json.dumps({"input": item.input}, ensure_ascii=False)
                function = {"name": prompt_name(item.name, item.namespace), "arguments": arguments}
                call = {"id": item.call_id, "type": "function", "function": function}
                if last.get("role") == "assistant" and not reasoning:  # a reply's words, then its calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append(with_reasoning({"role": "assistant", "tool_calls": [call]}))
                call_ids.add(item.call_id)
            case rp.FunctionCallOutputItem() | rp.CustomToolCallOutputItem():
                if item.call_id not in call_ids:
                    why = f"input: {item.type} {item.call_id[:64]!r} follows no call of that id"
                    raise ApiError(400, why, param="input")
                content = "\n".join(p.text for p in item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
    return messages


@dataclass
class ResponsesShape(Shape):
    """The reply as output items: a message for each stretch of text, a function_call or custom_tool_call for
    each call."""

    serving: Serving
    body: rp.ResponsesRequest
    response_id: str
    created: int
    blocks: ReplyBlocks
    offered: dict[str, Offered] = field(default_factory=dict)  # the tools behind the functions, by name
    store: ResponseStore | None = None  # where the finished response is kept; None: not kept
    item_ids: dict[int, str] = field(default_factory=dict)  # by block
    # the logprobs of tokens whose text the reply parser still holds (a stop string's or a marker's first part):
    # they go with the text they turn out to be, or are dropped when they turn out to be reasoning or a call
    held_logprobs: list[TokenLogprob] = field(default_factory=list)
    text_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # by text block
    sequence_number: int = 0
    end = ""
    closes_with_answer = True

    def _event(self, kind: type, **fields) -> Event:
        data = kind(sequence_number=self.sequence_number, **fields)
        self.sequence_number += 1
        return Event(data, data.type)

    def _response(self, status: str) -> rp.ResponseObject:
        body = self.body
        return rp.ResponseObject(
            id=self.response_id,
            created_at=self.created,
            status=status,
            model=self.serving.model_name,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls,
            temperature=body.temperature,
            top_p=body.top_p,
            tool_choice=body.tool_choice,
            tools=body.tools,
            text=body.text,
            metadata=body.metadata or {},
            user=body.user,
            store=self.store is not None,
            previous_response_id=body.previous_response_id,
        )

    def opening(self, choices: list[Choice]) -> list[Event]:
        return [
            self._event(rp.ResponseLifecycleEvent, type=kind, response=self._response("in_progress"))
            for kind in ("response.created", "response.in_progress")
        ]

    def events(self, c: Choice, out: RequestOutput) -> list[Event]:
        events: list[Event] = []
        self.held_logprobs += [token_logprob(self.serving, e) for e in out.logprobs or []]
        for step in self.blocks.feed(out):
            if not isinstance(step, Closed) and (step.block.reasoning or step.block.call is not None):
                self.held_logprobs.clear()  # the tokens were reasoning, a call or its marker
            events += self._step(step, c)
        c.num_reasoning_tokens = self.blocks.num_reasoning_tokens
        return events

    def _step(self, step: Step, c: Choice) -> list[Event]:
        block = step.block
        tool = self._tool(block)
        if isinstance(step, Opened):
            kind = ("rs" if block.reasoning else "msg") if tool is None else "ctc" if tool.custom else "fc"
            self.item_ids[block.index] = f"{kind}_{uuid.uuid4().hex}"
        at = {"item_id": self.item_ids[block.index], "output_index": block.index}
        match step:
            case Opened() if block.reasoning:
                added = [
                    self._item_event("added", block, "", "in_progress"),
                    self._part_event("added", block, ""),
                ]
                return added + self._summary_part("added", block, "")
            case Grew(piece=piece) if block.reasoning:
                delta = [self._event(rp.ReasoningTextDeltaEvent, content_index=0, delta=piece, **at)]
                if self.summarized:
                    delta.append(
                        self._event(rp.ReasoningSummaryTextDeltaEvent, summary_index=0, delta=piece, **at)
                    )
                return delta
            case Closed() if block.reasoning:
                status = "completed" if c.finish_reason in (None, "stop") else "incomplete"
                done = [
                    self._event(rp.ReasoningTextDoneEvent, content_index=0, text=block.text, **at),
                    self._part_event("done", block, block.text),
                ]
                if self.summarized:
                    done.append(
                        self._event(rp.ReasoningSummaryTextDoneEvent, summary_index=0, text=block.text, **at)
                    )
                    done += self._summary_part("done", block, block.text)
                return done + [self._item_event("done", block, block.text, status)]
            case Opened():  # empty: a feed's steps are all made before these are, the block may have grown
                added = [self._item_event("added", block, "", "in_progress")]
                if tool is None:
                    added.append(self._part_event("added", block, ""))
                return added
            case Grew(piece=piece) if tool is None:
                logprobs, self.held_logprobs = self.held_logprobs, []
                self.text_logprobs.setdefault(block.index, []).extend(logprobs)
                return [
                    self._event(
                        rp.OutputTextDeltaEvent, content_index=0, delta=piece, logprobs=logprobs, **at
                    )
                ]
            case Grew(piece=piece) if not tool.custom:
                return [self._event(rp.FunctionCallArgumentsDeltaEvent, delta=piece, **at)]
            case Grew():  # a custom call's input is known once its arguments' JSON is whole
                return []
            case Closed():
                # a block closes when the next one opens, or at the end: then it is whole if the reply is
                status = "completed" if c.finish_reason in (None, "stop") else "incomplete"
                if tool is None:
                    logprobs = self.text_logprobs.get(block.index, [])
                    done = [
                        self._event(
                            rp.OutputTextDoneEvent, content_index=0, text=block.text, logprobs=logprobs, **at
                        ),
                        self._part_event("done", block, block.text),
                    ]
                elif tool.custom:
                    text = custom_input(block.text)
                    done = [self._event(rp.CustomToolCallInputDeltaEvent, delta=text, **at)] if text else []
                    done.append(self._event(rp.CustomToolCallInputDoneEvent, input=text, **at))
                else:
                    done = [
                        self._event(
                            rp.FunctionCallArgumentsDoneEvent, name=tool.name, arguments=block.text, **at
                        )
                    ]
                return done + [self._item_event("done", block, block.text, status)]

    def _tool(self, block: Block) -> Offered | None:
        """The tool a call block calls (a plain function unless offered otherwise); None for text."""
        if block.call is None:
            return None
        return self.offered.get(block.call.name) or Offered(block.call.name, None, False)

    def _item_event(self, when: str, block: Block, text: str, status: str) -> Event:
        """output_item.added or .done: the block's item with that text (or arguments) and status."""
        item_id = self.item_ids[block.index]
        if block.reasoning:
            reasoning = [rp.ReasoningText(text=text)] if when == "done" else []
            summary = [rp.SummaryText(text=text)] if when == "done" and self.summarized else []
            item = rp.OutputReasoning(id=item_id, status=status, content=reasoning, summary=summary)
        elif block.call is None:
            content = [self._output_text(block, text)] if when == "done" else []
            item = rp.OutputMessage(id=item_id, status=status, content=content)
        else:
            tool = self._tool(block)
            common = {"id": item_id, "call_id": block.call.id, "name": tool.name, "namespace": tool.namespace}
            if tool.custom:
                item = rp.OutputCustomToolCall(**common, input=custom_input(text), status=status)
            else:
                item = rp.OutputFunctionCall(**common, arguments=text, status=status)
        return self._event(
            rp.OutputItemEvent, type=f"response.output_item.{when}", output_index=block.index, item=item
        )

    def _output_text(self, block: Block, text: str) -> rp.OutputText:
        """A message's text part, with its tokens' logprobs so far (none before it grows)."""
        return rp.OutputText(
            text=text, logprobs=list(self.text_logprobs.get(block.index, [])) if text else []
        )

    def _part_event(self, when: str, block: Block, text: str) -> Event:
        """content_part.added or .done: a message's one text part, or a reasoning item's."""
        return self._event(
            rp.ContentPartEvent,
            type=f"response.content_part.{when}",
            item_id=self.item_ids[block.index],
            output_index=block.index,
            content_index=0,
            part=rp.ReasoningText(text=text) if block.reasoning else self._output_text(block, text),
        )

    @property
    def summarized(self) -> bool:
        """The request asked for reasoning summaries: the reasoning is its own."""
        return self.body.reasoning is not None and self.body.reasoning.summarized

    def _summary_part(self, when: str, block: Block, text: str) -> list[Event]:
        """reasoning_summary_part.added or .done, when summaries are asked for."""
        if not self.summarized:
            return []
        return [
            self._event(
                rp.ReasoningSummaryPartEvent,
                type=f"response.reasoning_summary_part.{when}",
                item_id=self.item_ids[block.index],
                output_index=block.index,
                summary_index=0,
                part=rp.SummaryText(text=text),
            )
        ]

    def closing(self, answer: rp.ResponseObject, choices: list[Choice]) -> list[Event]:
        response = self.response(answer, choices)
        return [self._event(rp.ResponseLifecycleEvent, type=f"response.{response.status}", response=response)]

    def failed(self, error: ApiError) -> list[Event]:
        code = error.code or error.type
        return [self._event(rp.ResponseErrorEvent, code=code, message=error.message, param=error.param)]

    def empty(self, choices: list[Choice]) -> rp.ResponseObject:
        return self._response("in_progress")

    def add(self, answer: rp.ResponseObject, event) -> None:
        match event:
            case rp.OutputItemEvent(type="response.output_item.added"):
                answer.output.append(event.item.model_copy(deep=True))
            case rp.OutputItemEvent():  # done: the item whole
                answer.output[event.output_index] = event.item.model_copy(deep=True)
            case rp.ContentPartEvent(type="response.content_part.added"):
                answer.output[event.output_index].content.append(event.part.model_copy())
            case rp.OutputTextDeltaEvent():
                part = answer.output[event.output_index].content[event.content_index]
                part.text += event.delta
                part.logprobs += event.logprobs
            case rp.ReasoningTextDeltaEvent():
                answer.output[event.output_index].content[event.content_index].text += event.delta
            case rp.ReasoningSummaryPartEvent(type="response.reasoning_summary_part.added"):
                answer.output[event.output_index].summary.append(event.part.model_copy())
            case rp.ReasoningSummaryTextDeltaEvent():
                answer.output[event.output_index].summary[event.summary_index].text += event.delta
            case rp.FunctionCallArgumentsDeltaEvent():
                answer.output[event.output_index].arguments += event.delta
            case rp.CustomToolCallInputDeltaEvent():
                answer.output[event.output_index].input += event.delta

    def response(self, answer: rp.ResponseObject, choices: list[Choice]) -> rp.ResponseObject:
        (c,) = choices
        u = usage(choices)
        final = answer.model_copy(deep=True)
        final.usage = rp.ResponseUsage(
            input_tokens=u.prompt_tokens,
            input_tokens_details=rp.InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens),
            output_tokens=u.completion_tokens,
            output_tokens_details=rp.OutputTokensDetails(
                reasoning_tokens=u.completion_tokens_details.reasoning_tokens
            ),
            total_tokens=u.total_tokens,
        )
        if c.finish_reason == "stop":
            final.status = "completed"
            final.completed_at = int(time.time())
        elif c.finish_reason == "length":
            final.status = "incomplete"
            final.incomplete_details = rp.IncompleteDetails(reason="max_output_tokens")
        else:  # aborted: only a shutdown ends a request that way and still answers
            final.status = "failed"
            final.error = rp.ResponseError(code="server_error", message=SHUT_DOWN)
        if self.store is not None and final.status != "failed" and not self.store.put(final, self.body.input):
            log.warning("%s: not stored: larger than --responses-store-memory", self.response_id)
        return final
