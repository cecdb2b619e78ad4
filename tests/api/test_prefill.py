"""A reply's start given by the client (a prefill): Anthropic's final assistant message and vLLM's
continue_final_message render the conversation without the final turn's end, the model writes on from its last
character, and the reply holds only what it added."""

import json

import httpx
import pytest

pytestmark = pytest.mark.timeout(60)

START = [{"role": "user", "content": "Name a color"}, {"role": "assistant", "content": "My answer is"}]
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def client(tiny_engine, start_server) -> httpx.Client:
    url, _ = start_server(tiny_engine)
    return httpx.Client(base_url=url, timeout=30)


def detokenize(client: httpx.Client, ids: list[int]) -> str:
    return client.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_the_continued_prompt_is_the_conversation_up_to_the_final_messages_last_character(client):
    closed = client.post("/tokenize", json={"messages": START, "add_generation_prompt": False}).json()[
        "tokens"
    ]
    opened = client.post("/tokenize", json={"messages": START, "continue_final_message": True}).json()[
        "tokens"
    ]
    # the same conversation, less what the template closes the final turn with
    assert len(opened) < len(closed) and closed[: len(opened)] == opened
    assert detokenize(client, opened).endswith("My answer is")


def test_chat_and_messages_continue_the_same_prompt_with_the_same_tokens(client):
    opened = client.post("/tokenize", json={"messages": START, "continue_final_message": True}).json()[
        "tokens"
    ]
    # greedy from those prompt ids, as a plain completion: what both routes must write after the prefill
    expected = client.post("/v1/completions", json={"prompt": opened, **GREEDY}).json()["choices"][0]["text"]
    chat = client.post(
        "/v1/chat/completions", json={"messages": START, "continue_final_message": True, **GREEDY}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == expected
    assert chat.json()["usage"]["prompt_tokens"] == len(opened)
    message = client.post("/v1/messages", json={"model": "test-model", "messages": START, **GREEDY})
    assert message.status_code == 200, message.text
    assert [b["text"] for b in message.json()["content"]] == [expected]
    usage = message.json()["usage"]  # Anthropic's input_tokens leave out those read from the prefix cache
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(opened)
    counted = client.post("/v1/messages/count_tokens", json={"model": "test-model", "messages": START})
    assert counted.json() == {"input_tokens": len(opened)}
    # streamed, the same text
    with client.stream(
        "POST", "/v1/messages", json={"model": "test-model", "messages": START, "stream": True, **GREEDY}
    ) as r:
        deltas = [json.loads(line[6:]) for line in r.iter_lines() if '"text_delta"' in line]
    assert "".join(d["delta"]["text"] for d in deltas) == expected


def test_without_continue_final_message_a_final_assistant_message_is_a_closed_turn(client):
    chat = client.post("/v1/chat/completions", json={"messages": START, "max_tokens": 1}).json()
    opened = client.post("/tokenize", json={"messages": START, "continue_final_message": True}).json()[
        "count"
    ]
    closed = client.post("/tokenize", json={"messages": START}).json()["count"]  # and a new turn opened
    assert chat["usage"]["prompt_tokens"] == closed > opened


@pytest.mark.parametrize(
    "route, body, status, says",
    [
        ("/v1/chat/completions", {"messages": START[:1], "continue_final_message": True}, 400, "assistant"),
        (
            "/v1/chat/completions",
            {"messages": START, "continue_final_message": True, "add_generation_prompt": True},
            400,
            "cannot both be true",
        ),  # fmt: skip
        ("/tokenize", {"messages": START[:1], "continue_final_message": True}, 400, "assistant"),
        ("/tokenize", {"messages": [], "continue_final_message": True}, 400, "assistant"),  # was a 500
        (
            "/v1/messages",
            {"messages": [START[0], {**START[1], "content": "My answer is "}]},
            400,
            "trailing whitespace",
        ),
        (
            "/v1/messages",
            {"messages": START, "thinking": {"type": "enabled", "budget_tokens": 1024}},
            400,
            "thinking",
        ),
    ],
)
def test_a_prefill_that_cannot_be_continued_is_a_400_in_the_routes_shape(client, route, body, status, says):
    extra = {"model": "test-model", "max_tokens": 2} if route == "/v1/messages" else {"max_tokens": 2}
    r = client.post(route, json={**extra, **body} if route != "/tokenize" else body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"]
    if route == "/v1/messages":
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
