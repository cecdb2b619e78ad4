"""/v1/responses, OpenAI's Responses API, stateless: the input items become chat messages rendered through the
chat template as /v1/chat/completions renders them, and the reply streams as output items (a message's text,
function calls) in the Responses event sequence."""

import time
import uuid
from dataclasses import dataclass, field

from server.api import responses_protocol as rp
from server.api.blocks import Block, Closed, Grew, Opened, ReplyBlocks, Step
from server.api.chat import chat_prompt_ids
from server.api.choices import (
    Choice,
    Disconnected,
    Event,
    ServingState,
    answer,
    check_model,
    check_queue,
    new_choices,
    rest_of_context,
    sampling_params,
    usage,
)
from server.api.errors import ApiError
from server.api.structured import answer_grammar, compiled, offered_tools
from server.api.tools import Function, call_parser
from server.engine.request import RequestOutput

ENGINE_NAMES = {"prompt": "input", "max_tokens": "max_output_tokens"}  # the engine's field names, here
SHUT_DOWN = "the server shut down before the response was finished"


async def respond(state: ServingState, body: rp.ResponsesRequest, log_id: str, disconnected: Disconnected):
    """A ResponseObject, an SSE stream of strings, or None when the client went away."""
    check_model(state, body.model)
    check_queue(state)
    functions = [Function(t.name, t.description, t.parameters or {"type": "object"}) for t in body.tools]
    choice = body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.name
    tools = offered_tools(functions, choice, body.parallel_tool_calls)
    ids = chat_prompt_ids(state, chat_messages(body), tools=tools)
    params = sampling_params(body, body.max_output_tokens or rest_of_context(state, ids, "input"), None)
    params.grammar = await compiled(
        state, answer_grammar(body.text.format.output_schema(), "text.format", tools)
    )
    response_id = f"resp_{uuid.uuid4().hex}"
    choices = new_choices(state, response_id, 0, ids, params, names=ENGINE_NAMES)
    shape = ResponsesShape(state, body, response_id, int(time.time()), ReplyBlocks(call_parser(tools)))
    return await answer(state, choices, shape, log_id, disconnected, body.stream)


def chat_messages(body: rp.ResponsesRequest) -> list[dict]:
    """The conversation in the chat shape chat_prompt_ids() renders: the instructions as the system message,
    function calls as the tool_calls of the assistant message they follow, their outputs as tool messages."""
    messages: list[dict] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    call_ids = set()
    for item in body.input:
        last = messages[-1] if messages else {}
        match item:
            case rp.MessageItem():
                messages.append({"role": item.role, "content": "\n".join(p.text for p in item.content)})
            case rp.FunctionCallItem():
                function = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": function}
                if last.get("role") == "assistant":  # a reply's words, then its calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "tool_calls": [call]})
                call_ids.add(item.call_id)
            case rp.FunctionCallOutputItem():
                if item.call_id not in call_ids:
                    why = f"input: function_call_output {item.call_id[:64]!r} follows no function_call of that id"
                    raise ApiError(400, why, param="input")
                content = "\n".join(p.text for p in item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
    return messages


@dataclass
class ResponsesShape:
    """The reply as output items: a message for each stretch of text, a function_call for each call."""

    state: ServingState
    body: rp.ResponsesRequest
    response_id: str
    created: int
    blocks: ReplyBlocks
    item_ids: dict[int, str] = field(default_factory=dict)  # by block
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
            model=self.state.model_name,
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
        )

    def opening(self, choices: list[Choice]) -> list[Event]:
        return [
            self._event(rp.ResponseLifecycleEvent, type=kind, response=self._response("in_progress"))
            for kind in ("response.created", "response.in_progress")
        ]

    def events(self, c: Choice, out: RequestOutput) -> list[Event]:
        events: list[Event] = []
        for step in self.blocks.feed(out.text, final=out.finished):
            events += self._step(step, c)
        return events

    def _step(self, step: Step, c: Choice) -> list[Event]:
        block = step.block
        if isinstance(step, Opened):
            kind = "msg" if block.call is None else "fc"
            self.item_ids[block.index] = f"{kind}_{uuid.uuid4().hex}"
        at = {"item_id": self.item_ids[block.index], "output_index": block.index}
        text = block.call is None
        match step:
            case Opened():  # empty: a feed's steps are all made before these are, the block may have grown
                added = [self._item_event("added", block, "", "in_progress")]
                if text:
                    added.append(self._part_event("added", block, ""))
                return added
            case Grew(piece=piece) if text:
                return [self._event(rp.OutputTextDeltaEvent, content_index=0, delta=piece, **at)]
            case Grew(piece=piece):
                return [self._event(rp.FunctionCallArgumentsDeltaEvent, delta=piece, **at)]
            case Closed():
                # a block closes when the next one opens, or at the end: then it is whole if the reply is
                status = "completed" if c.finish_reason in (None, "stop") else "incomplete"
                if text:
                    done = [
                        self._event(rp.OutputTextDoneEvent, content_index=0, text=block.text, **at),
                        self._part_event("done", block, block.text),
                    ]
                else:
                    name = block.call.name
                    done = [
                        self._event(rp.FunctionCallArgumentsDoneEvent, name=name, arguments=block.text, **at)
                    ]
                return done + [self._item_event("done", block, block.text, status)]

    def _item_event(self, when: str, block: Block, text: str, status: str) -> Event:
        """output_item.added or .done: the block's item with that text (or arguments) and status."""
        item_id = self.item_ids[block.index]
        if block.call is None:
            content = [rp.OutputText(text=text)] if when == "done" else []
            item = rp.OutputMessage(id=item_id, status=status, content=content)
        else:
            call = block.call
            item = rp.OutputFunctionCall(
                id=item_id, call_id=call.id, name=call.name, arguments=text, status=status
            )
        return self._event(
            rp.OutputItemEvent, type=f"response.output_item.{when}", output_index=block.index, item=item
        )

    def _part_event(self, when: str, block: Block, text: str) -> Event:
        """content_part.added or .done: a message's one text part."""
        return self._event(
            rp.ContentPartEvent,
            type=f"response.content_part.{when}",
            item_id=self.item_ids[block.index],
            output_index=block.index,
            content_index=0,
            part=rp.OutputText(text=text),
        )

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
                answer.output[event.output_index].content[event.content_index].text += event.delta
            case rp.FunctionCallArgumentsDeltaEvent():
                answer.output[event.output_index].arguments += event.delta

    def response(self, answer: rp.ResponseObject, choices: list[Choice]) -> rp.ResponseObject:
        (c,) = choices
        u = usage(choices)
        final = answer.model_copy(deep=True)
        final.usage = rp.ResponseUsage(
            input_tokens=u.prompt_tokens,
            input_tokens_details=rp.InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens),
            output_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
        )
        if c.finish_reason == "stop":
            final.status = "completed"
        elif c.finish_reason == "length":
            final.status = "incomplete"
            final.incomplete_details = rp.IncompleteDetails(reason="max_output_tokens")
        else:  # aborted: only a shutdown ends a request that way and still answers
            final.status = "failed"
            final.error = rp.ResponseError(code="server_error", message=SHUT_DOWN)
        return final
