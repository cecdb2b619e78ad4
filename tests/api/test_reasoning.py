"""Reasoning apart from the answer on every API, through real clients (the openai SDK's chat and Responses,
langchain-openai, the anthropic SDK), against live servers on tiny thinking models whose greedy replies are
scripted by their weights (tests/helpers/thinking_models.py): the think format's "<think>Sum: 4</think>OK" and
harmony's analysis "Sum: 4" then final "OK" (or a get_weather call). The parser sees the engine's real token ids.
"""

import json

import anthropic
import httpx
import openai
import pytest

from server.api.app import create_app
from server.api.config import ServerConfig
from server.api.reasoning import choose_format
from tests.api.conftest import make_engine, serve
from tests.helpers import thinking_models as tm

pytestmark = pytest.mark.timeout(120)
MODEL = "thinker"
ASK = [{"role": "user", "content": "What is 2+2?"}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": [3, 4, 5]}},  # bounded: the model's own choice would not end
    "required": ["answer"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        # bounded: a forced call's free string would go on as long as the model's choices allow
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("thinkers")
    return {
        "think": tm.think_model(root / "think", max_len=2048),  # room for tools in the prompt
        "open": tm.think_model(root / "open", tm.OPEN_THINK_TEMPLATE),
        "loop": tm.think_model(root / "loop", script=tm.LOOP_SCRIPT, max_len=1200),
        "harmony": tm.harmony_model(root / "harmony"),
        "gemma4": tm.gemma4_model(root / "gemma4"),
        "gemma4_call": tm.gemma4_model(root / "gemma4_call", tm.GEMMA4_CALL_SCRIPT),
        "call": tm.harmony_model(root / "call", tm.HARMONY_CALL_SCRIPT),
    }


@pytest.fixture(scope="module")
def servers(models):
    """servers(name, **ServerConfig fields) -> base URL of a server on that model, started once per settings."""
    engines, running, stack = {}, {}, []

    def start(name: str, **config) -> str:
        key = (name, tuple(sorted(config.items())))
        if key not in running:
            if name not in engines:
                engines[name] = make_engine(models[name])
            server = serve(create_app(engines[name], ServerConfig(served_model_name=MODEL, **config)))
            stack.append(server)
            running[key] = server.__enter__()
        return running[key]

    yield start
    for server in reversed(stack):
        server.__exit__(None, None, None)
    for engine in engines.values():
        engine.shutdown()


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


def chat(url: str, **kw):
    return oai(url).chat.completions.create(model=MODEL, messages=ASK, temperature=0, **kw)


def streamed_chat(url: str, **kw) -> tuple[list[tuple[str, str]], object]:
    """The stream's deltas in order as (reasoning | content | tool, text), and its usage chunk."""
    deltas, usage = [], None
    stream = chat(url, stream=True, stream_options={"include_usage": True}, **kw)
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                deltas.append(("reasoning", extra["reasoning_content"]))
            if choice.delta.content:
                deltas.append(("content", choice.delta.content))
            for call in choice.delta.tool_calls or []:
                deltas.append(("tool", (call.function.name or "") + (call.function.arguments or "")))
    return deltas, usage


def joined(deltas, kind: str) -> str:
    return "".join(text for k, text in deltas if k == kind)


# --- Chat Completions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["think", "open", "harmony", "gemma4"])
def test_chat_gives_the_reasoning_apart(servers, name):
    """Qwen3's way (the model opens <think>), the R1 distills' (the prompt opened it), GPT-OSS's harmony and
    Gemma 4's thought channel (its label dropped)."""
    r = chat(servers(name))
    message = r.choices[0].message
    assert message.content == "OK" and r.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == "Sum: 4"
    reasoning_tokens = {"think": 8, "open": 7, "harmony": 10, "gemma4": 9}[name]
    assert r.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens


@pytest.mark.parametrize("name", ["think", "harmony", "gemma4"])
def test_chat_streams_the_reasoning_before_the_answer(servers, name):
    deltas, usage = streamed_chat(servers(name))
    kinds = [k for k, _ in deltas]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # every reasoning delta comes first
    assert len([k for k in kinds if k == "reasoning"]) >= 6  # streamed as generated, not at the end
    assert joined(deltas, "reasoning") == "Sum: 4" and joined(deltas, "content") == "OK"
    assert (
        usage.completion_tokens_details.reasoning_tokens
        == chat(servers(name)).usage.completion_tokens_details.reasoning_tokens
    )


def test_chat_template_kwargs_reach_the_template(servers):
    """Qwen3's enable_thinking false: the template closes the reasoning in the prompt, the reply is the answer."""
    url = servers("think")
    r = chat(url, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (
        r.choices[0].message.content == "OK" and r.choices[0].message.model_extra["reasoning_content"] is None
    )
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert r.usage.prompt_tokens == chat(url).usage.prompt_tokens + 6  # <think>\n\n</think>\n\n


def test_gemma4s_thinking_off_closes_the_channel_in_the_prompt(servers):
    """Gemma 4's template with enable_thinking false writes an empty thought channel: the reply is the answer."""
    url = servers("gemma4")
    r = chat(url, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = r.choices[0].message
    assert message.content == "OK" and message.model_extra["reasoning_content"] is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_reasoning_effort_reaches_the_template(servers):
    """GPT-OSS's template writes `Reasoning: <effort>` into the system message (medium by default)."""
    url = servers("harmony")
    tokens = {e: chat(url, reasoning_effort=e).usage.prompt_tokens for e in ("low", "medium", "high")}
    assert tokens["high"] - tokens["low"] == 1 and tokens["medium"] == chat(url).usage.prompt_tokens
    r = oai(url).responses.create(model=MODEL, input="What is 2+2?", reasoning={"effort": "high"})
    assert r.usage.input_tokens == tokens["high"]


@pytest.mark.parametrize("name", ["think", "harmony"])
def test_reasoning_in_the_history_reaches_the_template(servers, name):
    """An earlier turn's reasoning_content goes where the template reads it: GPT-OSS's `thinking` (our harmony
    template renders it as an analysis message); the think model's template renders none."""
    url = servers(name)
    turn = {"role": "assistant", "content": "4"}
    history = [*ASK, turn, {"role": "user", "content": "And 3+3?"}]
    plain = oai(url).chat.completions.create(model=MODEL, messages=history, max_tokens=1)
    history[1] = {**turn, "reasoning_content": "Sum: 4"}
    thought = oai(url).chat.completions.create(model=MODEL, messages=history, max_tokens=1)
    # harmony: <|start|> assistant <|channel|> analysis <|message|> S u m : _ 4 <|end|>
    grown = {"think": 0, "harmony": 12}
    assert thought.usage.prompt_tokens - plain.usage.prompt_tokens == grown[name]


def test_include_reasoning_false_leaves_it_out(servers):
    r = chat(servers("think"), extra_body={"include_reasoning": False})
    assert (
        r.choices[0].message.content == "OK" and r.choices[0].message.model_extra["reasoning_content"] is None
    )
    assert r.usage.completion_tokens_details.reasoning_tokens == 8


def test_the_none_parser_leaves_the_reasoning_in_the_answer(servers):
    r = chat(servers("think", reasoning_parser="none"))
    # the think model's markers are special tokens: the text keeps what is between them
    assert (
        r.choices[0].message.content == "Sum: 4OK"
        and r.choices[0].message.model_extra["reasoning_content"] is None
    )
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_gemma4s_own_calls_are_tool_calls(servers):
    """Gemma 4 writes <|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>: a call, its arguments JSON."""
    url = servers("gemma4_call")
    # the scripted model's memory is whether "Paris" came: the tool offered must not name it
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    r = chat(url, tools=[weather])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    deltas, _ = streamed_chat(url, tools=[weather])
    assert joined(deltas, "tool") == 'get_weather{"city": "Paris"}' and not joined(deltas, "content")
    # without the function offered, the call is not made: its text stays the answer's, as written
    r = chat(url)
    assert not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'


def test_harmony_commentary_calls_are_tool_calls(servers):
    url = servers("call")
    r = chat(url, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Sum: 4"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    deltas, _ = streamed_chat(url, tools=[WEATHER])
    assert [k for k, _ in deltas][0] == "reasoning" and joined(deltas, "reasoning") == "Sum: 4"
    assert joined(deltas, "tool") == 'get_weather{"city": "Paris"}'
    # a call of a function the request does not offer is not made
    r = chat(url)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


# --- grammars start after the reasoning -------------------------------------------------------------------


def answer_json(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"answer"} and isinstance(value["answer"], int)
    return value


@pytest.mark.parametrize("name", ["think", "open", "harmony"])
@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_chat_grammars_constrain_the_answer_only(servers, name, stream):
    """response_format and structured_outputs: the reasoning is the model's own, free; the answer is JSON of
    the schema (the model alone would answer "OK")."""
    url = servers(name)
    formats = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
        {"extra_body": {"structured_outputs": {"json": SCHEMA}}},
    ]
    for kw in formats:
        if stream:
            deltas, _ = streamed_chat(url, **kw)
            reasoning, content = joined(deltas, "reasoning"), joined(deltas, "content")
        else:
            message = chat(url, **kw).choices[0].message
            reasoning, content = message.model_extra["reasoning_content"], message.content
        assert reasoning == "Sum: 4"
        answer_json(content)


@pytest.mark.parametrize("name", ["think", "harmony"])
def test_chat_tool_grammars_constrain_the_answer_only(servers, name):
    """A forced call's grammar starts with the answer (harmony's final channel, where the call is written as
    kvserve's grammar writes calls)."""
    url = servers(name)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ["required", forced]:
        # one call: the model's own choice would be to call again and again
        r = chat(url, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False)
        message = r.choices[0].message
        assert (
            message.model_extra["reasoning_content"] == "Sum: 4"
            and r.choices[0].finish_reason == "tool_calls"
        )
        assert message.tool_calls[0].function.name == "get_weather"
        assert "city" in json.loads(message.tool_calls[0].function.arguments)
        deltas, _ = streamed_chat(url, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False)
        assert joined(deltas, "reasoning") == "Sum: 4" and joined(deltas, "tool").startswith("get_weather{")


def test_responses_and_messages_grammars_constrain_the_answer_only(servers):
    url = servers("think")
    text = {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}
    r = oai(url).responses.create(model=MODEL, input="What is 2+2?", text=text, temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Sum: 4"
    answer_json(r.output_text)
    with oai(url).responses.stream(model=MODEL, input="What is 2+2?", text=text, temperature=0) as stream:
        final = stream.get_final_response()
    assert final.output[0].content[0].text == "Sum: 4" and answer_json(final.output_text)
    kw = dict(
        model=MODEL,
        max_tokens=2048,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 1024},
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
        extra_body={"temperature": 0},
    )
    message = claude(url).messages.create(**kw)
    assert [b.type for b in message.content] == ["thinking", "text"] and message.content[
        0
    ].thinking == "Sum: 4"
    answer_json(message.content[1].text)
    with claude(url).messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == "Sum: 4" and answer_json(final.content[1].text)


# --- Responses ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["think", "harmony", "gemma4"])
def test_responses_gives_reasoning_items(servers, name):
    client = oai(servers(name))
    r = client.responses.create(model=MODEL, input="What is 2+2?", temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning = r.output[0]
    assert reasoning.id.startswith("rs_") and [c.text for c in reasoning.content] == ["Sum: 4"]
    assert r.output_text == "OK" and r.usage.output_tokens_details.reasoning_tokens > 0
    events = []
    with client.responses.stream(model=MODEL, input="What is 2+2?", temperature=0) as stream:
        for event in stream:
            events.append(event)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert (
        "".join(deltas) == "Sum: 4" and len(deltas) > 1
    )  # in pieces (a piece may merge steps the reader was behind on)
    last_reasoning = max(i for i, t in enumerate(types) if t == "response.reasoning_text.delta")
    assert last_reasoning < types.index("response.output_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == "Sum: 4" and done.output_index == 0
    assert final.output[0].content[0].text == "Sum: 4" and final.output_text == "OK"
    assert (
        final.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens_details.reasoning_tokens
    )


def test_responses_takes_reasoning_items_back(servers):
    """Agents (Codex) send a turn's reasoning items back with its calls: accepted, as the reasoning of that turn."""
    client = oai(servers("call"))
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, temperature=0)
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        *[o.model_dump(exclude_none=True) for o in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = client.responses.create(model=MODEL, input=history, tools=tools, temperature=0)
    assert second.status == "completed"


def test_responses_summaries_are_the_reasoning(servers):
    """Clients that show only reasoning summaries (Codex) ask for them: the reasoning is its own summary."""
    client = oai(servers("think"))
    kw = dict(model=MODEL, input="What is 2+2?", temperature=0, reasoning={"summary": "auto"})
    r = client.responses.create(**kw)
    assert [s.text for s in r.output[0].summary] == [c.text for c in r.output[0].content] == ["Sum: 4"]
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(deltas) == "Sum: 4" and len(deltas) > 1
    assert [e.part.text for e in events if e.type == "response.reasoning_summary_part.done"] == ["Sum: 4"]


def test_langchain_shows_the_reasoning_apart(servers):
    """langchain-openai's ChatOpenAI on the Responses API: reasoning blocks apart from the text, streamed or not,
    and the reasoning tokens in its usage."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{servers('think')}/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        use_responses_api=True,
        reasoning={"summary": "auto"},
        output_version="v1",
    )
    message = llm.invoke("What is 2+2?")
    kinds = [b["type"] for b in message.content_blocks]
    assert kinds == ["reasoning", "text"], message.content_blocks
    assert message.content_blocks[0]["reasoning"] == "Sum: 4" and message.text == "OK"
    assert message.usage_metadata["output_token_details"]["reasoning"] == 8
    chunks = list(llm.stream("What is 2+2?"))
    assert len(chunks) > 1  # streamed as it came (a chunk may merge steps the reader was behind on)
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    reasoning = [b for b in whole.content_blocks if b["type"] == "reasoning"]
    assert "".join(b.get("reasoning", "") for b in reasoning) == "Sum: 4" and whole.text == "OK"


# --- Messages -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["think", "harmony", "gemma4"])
def test_messages_gives_thinking_blocks_when_enabled(servers, name):
    client = claude(servers(name))
    kw = dict(model=MODEL, max_tokens=2048, messages=ASK, extra_body={"temperature": 0})
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = client.messages.create(**kw, thinking=thinking)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Sum: 4" and message.content[0].signature
    assert message.content[1].text == "OK" and message.stop_reason == "end_turn"
    events = []
    with client.messages.stream(**kw, thinking=thinking) as stream:
        for event in stream:
            events.append(event)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    thoughts = [d.thinking for d in deltas if d.type == "thinking_delta"]
    assert "".join(thoughts) == "Sum: 4" and len(thoughts) >= 6
    kinds = [d.type for d in deltas]
    assert kinds.index("signature_delta") < kinds.index("text_delta")
    assert final.content[0].thinking == "Sum: 4" and final.content[1].text == "OK"
    # display omitted: the block comes, signed, without its text
    omitted = client.messages.create(**kw, thinking={"type": "adaptive", "display": "omitted"})
    assert [(b.type, getattr(b, "thinking", None)) for b in omitted.content] == [
        ("thinking", ""),
        ("text", None),
    ]
    assert omitted.content[0].signature
    # not enabled: no thinking blocks (a template that can leave the thinking out is asked to)
    for off in [{}, {"thinking": {"type": "disabled"}}]:
        message = client.messages.create(**kw, **off)
        assert [(b.type, b.text) for b in message.content] == [("text", "OK")]
        counted = client.messages.count_tokens(model=MODEL, messages=ASK, **off).input_tokens
        assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_messages_takes_thinking_blocks_back(servers):
    client = claude(servers("think"))
    thinking = {"type": "enabled", "budget_tokens": 1024}
    first = client.messages.create(model=MODEL, max_tokens=2048, messages=ASK, thinking=thinking)
    history = [*ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": "And 3+3?"}]
    second = client.messages.create(model=MODEL, max_tokens=2048, messages=history, thinking=thinking)
    assert second.content[0].type == "thinking"
    redacted = [{"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "4"}]
    history = [*ASK, {"role": "assistant", "content": redacted}, {"role": "user", "content": "And 3+3?"}]
    assert client.messages.create(model=MODEL, max_tokens=2048, messages=history).content[0].text == "OK"


def test_the_thinking_budget_bounds_the_thinking(servers):
    """The loop model thinks "abcabc..." until stopped: at budget_tokens the thinking is closed, then the answer."""
    client = claude(servers("loop"))
    message = client.messages.create(
        model=MODEL,
        max_tokens=1100,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    )
    thinking, text = message.content
    assert thinking.thinking == ("abc" * 400)[:1023] and text.text == "OK"  # 1024 with <think>
    assert message.usage.output_tokens == 1024 + 1 + 2 + 1  # </think>, "OK", the end token
    # a budget past max_tokens is taken (Anthropic takes one with interleaved thinking): max_tokens ends it first
    short = client.messages.create(
        model=MODEL,
        max_tokens=50,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    )
    assert short.stop_reason == "max_tokens" and [b.type for b in short.content] == ["thinking"]


def test_bad_reasoning_fields_are_400s_in_each_apis_shape(servers):
    url = servers("think")
    with pytest.raises(openai.BadRequestError) as e:
        chat(url, reasoning_effort="extreme")
    assert "reasoning_effort" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        chat(url, extra_body={"chat_template_kwargs": {"messages": []}})
    assert "chat_template_kwargs: messages cannot be set" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai(url).responses.create(model=MODEL, input="hi", reasoning={"effort": "extreme"})
    assert "effort" in str(e.value)
    for thinking, why in [
        ({"type": "enabled", "budget_tokens": 100}, "must be at least 1024"),
        ({"type": "enabled"}, "budget_tokens is required"),
        ({"type": "sometimes"}, "thinking.type"),
    ]:
        body = {"model": MODEL, "max_tokens": 2048, "messages": ASK, "thinking": thinking}
        r = httpx.post(f"{url}/v1/messages", json=body)
        assert r.status_code == 400, r.text
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert why in error["error"]["message"], error


# --- choosing the format ------------------------------------------------------------------------------


def test_the_format_is_chosen_from_the_template_or_the_flag(servers, models):
    from model.tokenizer import Tokenizer

    think, harmony = Tokenizer.from_dir(models["think"]), Tokenizer.from_dir(models["harmony"])
    assert choose_format(think)[0].name == "think" and choose_format(harmony)[0].name == "harmony"
    assert choose_format(Tokenizer.from_dir(models["gemma4"]))[0].name == "gemma4"
    assert choose_format(think, "qwen3")[0].name == choose_format(think, "deepseek_r1")[0].name == "think"
    assert choose_format(harmony, "gpt_oss")[0].name == "harmony"
    assert choose_format(think, "none")[0] is None
    # a format whose markers the tokenizer lacks: none, and the reasoning stays in the answer
    fmt, why = choose_format(think, "harmony")
    assert fmt is None and "no single token for <|start|>" in why
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        choose_format(think, "r1")
