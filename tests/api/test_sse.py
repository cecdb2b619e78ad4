"""Server-sent events as raw bytes: framing, [DONE], the usage chunk, roles, UTF-8, errors after the start; the
named events of /v1/responses and /v1/messages."""

import json

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "Say hello."}]}


def stream(url: str, path: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{url}{path}", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return r


@pytest.mark.timeout(60)
def test_completion_stream_framing_and_usage_chunk(tiny_engine, start_server, sse_events):
    url, _ = start_server(tiny_engine)
    body = {"prompt": ["one", "two"], "n": 2, "max_tokens": 6, "ignore_eos": True, "seed": 3}
    body["stream_options"] = {"include_usage": True}
    chunks = sse_events(stream(url, "/v1/completions", body).content)
    *deltas, last = chunks
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["created"] for c in chunks}) == 1
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in deltas)
    finished = [c["choices"][0]["index"] for c in deltas if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2, 3]  # prompt-major: choices 0, 1 of "one", then 2, 3 of "two"
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["completion_tokens"] == 4 * 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    # without include_usage there is no usage chunk
    plain = sse_events(stream(url, "/v1/completions", {"prompt": "x", "max_tokens": 3}).content)
    assert all(c["choices"] for c in plain)


@pytest.mark.timeout(60)
def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(
    tiny_engine, start_server, sse_events
):
    # vLLM's stream_options.continuous_usage_stats, as its clients read it
    url, _ = start_server(tiny_engine)
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in [
        ("/v1/completions", {"prompt": "one two", "n": 2, "max_tokens": 5, "ignore_eos": True, "seed": 3}),
        ("/v1/chat/completions", {**CHAT, "n": 2, "max_tokens": 5, "ignore_eos": True, "seed": 3}),
    ]:
        chunks = sse_events(stream(url, path, {**body, "stream_options": options}).content)
        *deltas, last = chunks
        prompt_tokens = last["usage"]["prompt_tokens"]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * 5
        for index in (0, 1):
            mine = [c for c in deltas if c["choices"][0]["index"] == index]
            counts = [c["usage"]["completion_tokens"] for c in mine]
            assert counts == sorted(counts) and counts[-1] == 5, counts
            assert all(
                c["usage"]["prompt_tokens"] == prompt_tokens for c in mine
            )  # each choice counts its prompt
            assert all(
                c["usage"]["total_tokens"] == prompt_tokens + n for c, n in zip(mine, counts, strict=True)
            )
        if path == "/v1/chat/completions":  # the role's chunk comes before any output
            assert all(
                c["usage"]["completion_tokens"] == 0 for c in deltas if "role" in c["choices"][0]["delta"]
            )


@pytest.mark.timeout(60)
def test_chat_stream_role_first_then_content(tiny_engine, start_server, sse_events):
    url, _ = start_server(tiny_engine)
    body = {**CHAT, "n": 2, "max_tokens": 5, "seed": 1, "logprobs": True, "top_logprobs": 2}
    chunks = sse_events(stream(url, "/v1/chat/completions", body).content)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in mine[1:])
        assert mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        tokens = [t for c in mine[1:] for t in c["logprobs"]["content"]]
        assert len(tokens) == 5
        assert all(len(t["top_logprobs"]) == 2 and isinstance(t["bytes"], list) for t in tokens)


@pytest.mark.timeout(60)
def test_completion_logprobs_and_echo(tiny_engine, start_server, sse_events):
    url, _ = start_server(tiny_engine)
    body = {"prompt": "hello there", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    full = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    assert full["text"].startswith("hello there")
    lp = full["logprobs"]
    n_prompt = len(httpx.post(f"{url}/tokenize", json={"prompt": "hello there"}).json()["tokens"])
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n_prompt + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    # the two most likely, and the token itself wherever it ranks (OpenAI's: up to logprobs + 1)
    assert all(2 <= len(t) <= 3 for t in lp["top_logprobs"][1:])
    assert all(
        t[tok] == x
        for tok, x, t in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True)
    )
    assert any(len(t) == 3 for t in lp["top_logprobs"][1:n_prompt])  # a prompt token the model did not expect
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # the stream carries the same, in pieces
    chunks = sse_events(stream(url, "/v1/completions", body).content)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == lp["tokens"]
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]


@pytest.mark.timeout(60)
def test_echo_with_max_tokens_0_scores_the_prompt_alone(tiny_engine, start_server, sse_events):
    """A prompt's log-likelihood, as evaluation harnesses ask for it (lm-evaluation-harness's completions
    backend): echo, logprobs, max_tokens 0. The prompt and its logprobs come back, nothing generated, the same
    as with max_tokens 4 up to the prompt's end; max_tokens 0 without echo is a 400."""
    url, _ = start_server(tiny_engine)
    body = {"prompt": "hello there", "max_tokens": 0, "logprobs": 1, "echo": True, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body).json()
    choice, usage = r["choices"][0], r["usage"]
    n_prompt = len(httpx.post(f"{url}/tokenize", json={"prompt": "hello there"}).json()["tokens"])
    assert choice["text"] == "hello there" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["token_logprobs"]) == n_prompt
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == n_prompt
    longer = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 4}).json()["choices"][0][
        "logprobs"
    ]
    assert longer["token_logprobs"][:n_prompt] == choice["logprobs"]["token_logprobs"]
    chunks = sse_events(stream(url, "/v1/completions", body).content)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hello there"
    r = httpx.post(f"{url}/v1/completions", json={**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.timeout(60)
def test_include_stop_str_in_output_keeps_the_stop_string(tiny_engine, start_server, sse_events):
    """vLLM's include_stop_str_in_output: the stop string that ended the text stays at its end, streamed or not."""
    url, _ = start_server(tiny_engine)
    body = {"prompt": "hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
    stop = next(free[i : i + 2] for i in range(len(free) // 2, len(free) - 1) if free[i : i + 2].strip())
    cut = free[: free.index(stop)]
    for keep, text in ((False, cut), (True, cut + stop)):
        asked = {**body, "stop": [stop], "include_stop_str_in_output": keep}
        choice = httpx.post(f"{url}/v1/completions", json=asked).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (text, "stop"), (free, stop)
        chunks = sse_events(stream(url, "/v1/completions", asked).content)
        assert "".join(c["choices"][0]["text"] for c in chunks) == text


@pytest.mark.timeout(60)
def test_an_engine_failure_after_the_start_is_one_error_event(
    tiny_llama_dir, new_engine, start_server, sse_events, wait_for
):
    engine = new_engine(tiny_llama_dir)
    step, calls = engine._engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated fault in /some/file.py")
        return step()

    engine._engine.step = failing_step
    url, _ = start_server(engine)
    # ignore_eos: an unseeded random model could otherwise end before the failing step
    chunks = sse_events(
        stream(url, "/v1/chat/completions", {**CHAT, "max_tokens": 20, "ignore_eos": True}).content
    )
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    error = chunks[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"} and "file.py" not in error["message"]
    assert all("error" not in c for c in chunks[:-1])
    # not streamed: a 500 with the same generic body
    calls.clear()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 20, "ignore_eos": True})
    assert r.status_code == 500 and "file.py" not in r.text
    wait_for(lambda: engine.stats().kv_cache_usage == 0, timeout=2, what="blocks freed")


RESPONSES = {"input": "Say hello.", "max_output_tokens": 6, "ignore_eos": True}
MESSAGES = {"messages": CHAT["messages"], "max_tokens": 6, "ignore_eos": True}


@pytest.mark.timeout(60)
def test_responses_stream_is_named_events_in_order(tiny_engine, start_server, named_sse_events):
    url, _ = start_server(tiny_engine)
    events = named_sse_events(stream(url, "/v1/responses", RESPONSES).content)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert types[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",  # cut by max_output_tokens
    ]  # fmt: skip
    final = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text and final["usage"]["output_tokens"] == 6
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    full = httpx.post(f"{url}/v1/responses", json={**RESPONSES, "seed": 1}, timeout=60).json()
    assert full["status"] == "incomplete" and full["usage"]["output_tokens"] == 6


@pytest.mark.timeout(60)
def test_messages_stream_is_named_events_in_order(tiny_engine, start_server, named_sse_events):
    url, _ = start_server(tiny_engine)
    events = named_sse_events(stream(url, "/v1/messages", MESSAGES).content)
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 6


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/responses", {**RESPONSES, "max_output_tokens": 20}),
        ("/v1/messages", {**MESSAGES, "max_tokens": 20}),
    ],
)
def test_a_failure_after_the_start_ends_named_streams_with_an_error_event(
    route, body, tiny_llama_dir, new_engine, start_server, named_sse_events
):
    engine = new_engine(tiny_llama_dir)
    step, calls = engine._engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated fault in /some/file.py")
        return step()

    engine._engine.step = failing_step
    url, _ = start_server(engine)
    events = named_sse_events(stream(url, route, body).content)
    last = events[-1]
    assert last["type"] == "error" and "file.py" not in json.dumps(last)
    if route == "/v1/messages":
        assert last["error"]["type"] == "api_error" and last["error"]["message"]
    else:
        assert last["message"] and isinstance(last["sequence_number"], int)
    assert all(e["type"] != "error" for e in events[:-1])


# --- the real model -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_streamed_text_equals_non_streamed_for_the_same_seed(default_server, sse_events):
    body = {**CHAT, "max_tokens": 16, "temperature": 0.9, "seed": 1234}
    full = httpx.post(f"{default_server}/v1/chat/completions", json=body, timeout=60).json()
    chunks = sse_events(stream(default_server, "/v1/chat/completions", body).content)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == full["choices"][0]["message"]["content"] != ""
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_emoji_and_cjk_arrive_whole(default_server, sse_events):
    # Characters of 3-4 UTF-8 bytes span several byte-level tokens: no delta may end inside one.
    body = {"prompt": "猫 🐱 犬 🐶 鳥 🐦 魚 🐟 馬 🐴 牛 🐮", "max_tokens": 16, "temperature": 0}
    full = httpx.post(f"{default_server}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    raw = stream(default_server, "/v1/completions", body).content
    pieces = [c["choices"][0]["text"] for c in sse_events(raw)]
    assert "".join(pieces) == full
    assert any(ord(ch) > 0x2E7F for ch in full), full  # the model did answer in CJK or emoji
    # Only a length cut inside the last character may leave a replacement character, at the very end.
    assert "\ufffd" not in full.rstrip("\ufffd") and not any("\ufffd" in p for p in pieces[:-1])


def test_an_event_is_one_line_for_readers_that_split_like_str_splitlines():
    """A model may write U+0085, U+2028 or U+2029, which JSON leaves raw but str.splitlines() (httpx's
    aiter_lines()) ends a line at: escaped, the event stays one line and means the same."""
    from pydantic import BaseModel

    from server.api.shape import Event

    class Delta(BaseModel):
        text: str

    text = "a\x85b\u2028c\u2029d\x0be\x1cf\r\ng é 🙂"
    wire = Event(Delta(text=text), "content_block_delta").sse()
    event, data, blank, end = wire.split("\n")
    assert (event, blank, end) == ("event: content_block_delta", "", "")
    assert data.splitlines() == [data]
    assert json.loads(data.removeprefix("data: "))["text"] == text
