"""Responses and Messages answers without a model: scripted engine outputs (text, calls in the Hermes form split
at awkward places, a stop string, a length cut) go through the shared answer path, and the official SDKs read
the result over a mock transport. What each SDK accumulates from the stream must equal the non-streamed body."""

import asyncio
import importlib
import json
import time

import anthropic
import openai
import pytest

from server.api.anthropic import protocol as mp
from server.api.anthropic.messages import MessagesShape
from server.api.blocks import Closed, Grew, Opened, ReplyBlocks
from server.api.metrics import Metrics
from server.api.openai import responses_protocol as rp
from server.api.openai.responses import ResponsesShape
from server.api.reasoning import ReplyParser
from server.api.serving import Serving
from server.api.shape import Choice
from server.api.tools import Function, ToolCallParser, Tools, call_parser, new_call_id
from server.engine.request import FinishReason, RequestOutput, SamplingParams
from server.engine.stats import EngineStats

pytestmark = pytest.mark.timeout(60)

PROMPT = [1, 2, 3, 4, 5]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = Tools([Function("get_weather", "Weather in a city", WEATHER)])
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# The SDKs' HTTP library: httpx, or its fork httpx2 in their newest releases (the same API).
http = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


class ScriptedEngine:
    """Generates the same deltas for every request."""

    def __init__(
        self, deltas: list[str], finish: str = "stop", stop_string: str | None = None, cached: int = 0
    ):
        self.deltas, self.finish, self.stop_string, self.cached = deltas, finish, stop_string, cached

    def stats(self) -> EngineStats:  # an idle engine's: nothing waits
        return EngineStats()

    async def generate(self, request_id: str, ids: list[int], params: SamplingParams, arrival_time: float):
        for i, text in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            yield RequestOutput(
                request_id,
                [100 + i],
                text,
                finished=last,
                finish_reason=FinishReason(self.finish) if last else None,
                num_prompt_tokens=len(ids),
                num_output_tokens=i + 1,
                num_cached_tokens=self.cached,
                stop_string=self.stop_string if last else None,
            )


def serve(make_shape, engine: ScriptedEngine) -> http.MockTransport:
    """A transport that answers every request with the shape's answer to the engine's deltas."""
    metrics = Metrics("m", lambda: None)
    serving = Serving(engine, "m", None, 10, metrics, "t", time.monotonic(), asyncio.Event().wait)

    async def respond(streamed: bool) -> str:
        choices = [Choice(0, "r-0", PROMPT, SamplingParams())]
        result = await serving.answer(choices, make_shape(serving), streamed)
        return "".join([s async for s in result]) if streamed else result.model_dump_json()

    def handler(request: http.Request) -> http.Response:
        streamed = json.loads(request.content).get("stream", False)
        kind = "text/event-stream" if streamed else "application/json"
        return http.Response(200, text=asyncio.run(respond(streamed)), headers={"content-type": kind})

    return http.MockTransport(handler)


def responses_client(engine: ScriptedEngine, tools: Tools | None = None, **request) -> openai.OpenAI:
    body = rp.ResponsesRequest.model_validate({"input": "hi", **request})

    def shape(serving):
        return ResponsesShape(
            serving, body, "resp_1", 0, ReplyBlocks(ReplyParser(None, calls=call_parser(tools)))
        )

    client = openai.DefaultHttpxClient(transport=serve(shape, engine))
    return openai.OpenAI(base_url="http://kvserve/v1", api_key="x", http_client=client, max_retries=0)


def messages_client(engine: ScriptedEngine, tools: Tools | None = None, **request) -> anthropic.Anthropic:
    body = mp.MessagesRequest.model_validate(
        {"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], **request}
    )

    def shape(serving):
        parser = call_parser(tools, new_id=lambda: new_call_id("toolu_"))
        return MessagesShape(serving, body, "msg_1", ReplyBlocks(ReplyParser(None, calls=parser)))

    client = anthropic.DefaultHttpxClient(transport=serve(shape, engine))
    return anthropic.Anthropic(base_url="http://kvserve", api_key="x", http_client=client, max_retries=0)


def output(text: str, final: bool) -> RequestOutput:
    return RequestOutput("r", [], text, finished=final)


def same_calls(a, b) -> None:
    """Call ids are drawn per answer: equal up to them."""
    for x, y in zip(a, b, strict=True):
        assert (x.type, getattr(x, "name", None)) == (y.type, getattr(y, "name", None))


# --- the blocks --------------------------------------------------------------------------------------


def test_blocks_open_grow_and_close_in_reply_order():
    blocks = ReplyBlocks(ReplyParser(None, calls=ToolCallParser({"get_weather"}, new_id=lambda: "c")))
    steps = []
    text = "Let me look.\n" + CALL + "\n" + CALL
    for i, piece in enumerate(pieces(text, 3)):
        steps += blocks.feed(output(piece, final=i == len(pieces(text, 3)) - 1))
    kinds = [(type(s).__name__, s.block.index) for s in steps if not isinstance(s, Grew)]
    assert kinds == [("Opened", 0), ("Closed", 0), ("Opened", 1), ("Closed", 1), ("Opened", 2), ("Closed", 2)]
    assert [b.text for b in blocks.blocks] == ["Let me look.", '{"city": "Paris"}', '{"city": "Paris"}']
    assert blocks.num_calls == 2
    assert (
        "".join(s.piece for s in steps if isinstance(s, Grew) and s.block.index == 1) == '{"city": "Paris"}'
    )
    # text alone, no parser: one block
    plain = ReplyBlocks(ReplyParser(None))
    steps = plain.feed(output("a", False)) + plain.feed(output("b", True))
    assert [type(s) for s in steps] == [Opened, Grew, Grew, Closed] and plain.blocks[0].text == "ab"


# --- Responses ---------------------------------------------------------------------------------------


def test_responses_text_stream_accumulates_to_the_body():
    engine = ScriptedEngine(["Hello", ", wor", "ld."], cached=2)
    client = responses_client(engine)
    body = client.responses.create(model="m", input="hi")
    assert body.status == "completed" and body.output_text == "Hello, world."
    assert body.id == "resp_1" and body.output[0].type == "message" and body.output[0].status == "completed"
    assert body.usage.input_tokens == 5 and body.usage.output_tokens == 3
    assert body.usage.input_tokens_details.cached_tokens == 2 and body.usage.total_tokens == 8
    with client.responses.stream(model="m", input="hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert types[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello, world."
    assert final.output_text == body.output_text and final.usage == body.usage
    assert final.output[0].id == events[2].item.id  # the item keeps its id from added to completed


def test_responses_tool_calls_stream_as_function_call_items():
    engine = ScriptedEngine(pieces("Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"), 4))
    client = responses_client(engine, TOOLS)
    body = client.responses.create(model="m", input="hi")
    message, first, second = body.output
    assert message.type == "message" and message.content[0].text == "Checking."
    assert (first.type, first.name, first.arguments, first.status) == (
        "function_call", "get_weather", '{"city": "Paris"}', "completed",
    )  # fmt: skip
    assert (
        first.call_id.startswith("call_") and first.id.startswith("fc_") and first.call_id != second.call_id
    )
    assert json.loads(second.arguments) == {"city": "Oslo"}
    with client.responses.stream(model="m", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    same_calls(final.output, body.output)
    assert [o.arguments for o in final.output[1:]] == [first.arguments, second.arguments]
    assert len(deltas) > 4 and "".join(deltas) == first.arguments + second.arguments


def test_responses_cut_by_max_output_tokens_is_incomplete():
    client = responses_client(ScriptedEngine(["Once", " upon"], finish="length"))
    body = client.responses.create(model="m", input="hi")
    assert body.status == "incomplete" and body.incomplete_details.reason == "max_output_tokens"
    assert body.output[0].status == "incomplete" and body.output_text == "Once upon"
    with client.responses.stream(model="m", input="hi") as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.output_text == "Once upon"


# a reply cut by max_tokens while it opened a second call
CUT_IN_A_CALL = pieces("Checking.\n" + CALL + '\n<tool_call>\n{"name": "get_wea', 4)


def test_responses_cut_inside_a_calls_opening_show_no_markup():
    client = responses_client(ScriptedEngine(CUT_IN_A_CALL, finish="length"), TOOLS)
    body = client.responses.create(model="m", input="hi")
    # the second call, cut inside its name, is the one declared function it can be, its arguments not begun
    assert [item.type for item in body.output] == ["message", "function_call", "function_call"]
    assert body.output_text == "Checking." and body.output[1].arguments == '{"city": "Paris"}'
    assert body.output[2].name == "get_weather" and body.output[2].arguments == ""
    with client.responses.stream(model="m", input="hi") as stream:
        events = list(stream)
    assert "<" not in "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == "Checking."


# --- Messages ----------------------------------------------------------------------------------------


def test_messages_text_stream_accumulates_to_the_body():
    client = messages_client(ScriptedEngine(["Hello", ", wor", "ld."], cached=2))
    body = client.messages.create(model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    assert [b.type for b in body.content] == ["text"] and body.content[0].text == "Hello, world."
    assert body.stop_reason == "end_turn" and body.stop_sequence is None and body.id == "msg_1"
    u = body.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.output_tokens) == (
        3,
        2,
        3,
    )  # cached apart, as Anthropic
    with client.messages.stream(model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "Hello, world." and final.model_dump() == body.model_dump()
    # message_start's input usage is the final one's: it waits for the first output, when the cache is looked up
    with client.messages.stream(model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}]) as s:
        start = next(e for e in s if e.type == "message_start").message.usage
    assert (start.input_tokens, start.cache_read_input_tokens) == (u.input_tokens, u.cache_read_input_tokens)


def test_messages_tool_use_blocks_stream_their_input_json():
    engine = ScriptedEngine(pieces("Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"), 5))
    client = messages_client(engine, TOOLS)
    kw = dict(model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    body = client.messages.create(**kw)
    text, first, second = body.content
    assert text.text == "Checking." and body.stop_reason == "tool_use"
    assert (first.type, first.name, first.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert first.id.startswith("toolu_") and second.input == {"city": "Oslo"}
    with client.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    same_calls(final.content, body.content)
    assert [b.input for b in final.content[1:]] == [{"city": "Paris"}, {"city": "Oslo"}]
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 1]
    assert len(partial) > 2 and "".join(partial) == '{"city": "Paris"}'
    assert [e.type for e in events if e.type.startswith("message")][-2:] == ["message_delta", "message_stop"]


def test_messages_cut_inside_a_calls_opening_show_no_markup():
    client = messages_client(ScriptedEngine(CUT_IN_A_CALL, finish="length"), TOOLS)
    kw = dict(model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    body = client.messages.create(**kw)
    # the second call, cut inside its name: a tool_use of the one tool it can be, its input not begun
    assert [b.type for b in body.content] == ["text", "tool_use", "tool_use"]
    assert body.content[0].text == "Checking." and body.content[1].input == {"city": "Paris"}
    assert body.content[2].name == "get_weather" and body.content[2].input == {}
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"] and final.content[
        0
    ].text == "Checking."
    assert final.content[2].input == {}


@pytest.mark.parametrize(
    "engine, reason, sequence",
    [
        (ScriptedEngine(["Hello"], stop_string="END"), "stop_sequence", "END"),
        (ScriptedEngine(["Hel", "lo"], finish="length"), "max_tokens", None),
        (ScriptedEngine(["Hel"], finish="length"), "model_context_window_exceeded", None),  # 1 of 2 tokens
    ],
)
def test_messages_stop_reasons(engine, reason, sequence):
    client = messages_client(engine, max_tokens=2)
    kw = dict(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    body = client.messages.create(**kw)
    assert (body.stop_reason, body.stop_sequence) == (reason, sequence)
    with client.messages.stream(**kw) as s:
        assert s.get_final_message().model_dump() == body.model_dump()


def test_an_aborted_message_is_an_error_in_anthropic_shape():
    client = messages_client(ScriptedEngine(["Hel"], finish="abort"))
    kw = dict(model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.APIStatusError) as e, client.messages.stream(**kw) as s:
        s.get_final_message()
    assert e.value.body["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize(
    "deltas, reasoning",
    [
        (["thought\nSum", ": 4"], "Sum: 4"),  # the label whole in one delta
        (["tho", "ught", "\n", "Sum: 4"], "Sum: 4"),  # split over deltas: held back until whole
        (["thou"], "thou"),  # a part of it, then the channel closes: reasoning after all
        (["thinking it over"], "thinking it over"),  # no label: nothing dropped
    ],
)
def test_gemma4s_channel_label_is_not_reasoning(deltas, reasoning):
    """Gemma 4 writes <|channel>thought\\n...<channel|>: the label "thought\\n" is the channel's, dropped however the
    deltas cut it, and kept where it never comes whole."""
    from server.api.reasoning import ReasoningFormat

    fmt = ReasoningFormat("gemma4", {"<|channel>": 100, "<channel|>": 101})
    parser = ReplyParser(fmt, start="open")
    pieces = parser.feed(RequestOutput("r", [100], "", marks=[(0, 100)]))
    for text in deltas:
        pieces += parser.feed(RequestOutput("r", [7], text))
    pieces += parser.feed(RequestOutput("r", [101, 8], "OK", finished=True, marks=[(0, 101)]))
    assert "".join(p.text for p in pieces if p.kind == "reasoning") == reasoning
    assert "".join(p.text for p in pieces if p.kind == "content") == "OK"
