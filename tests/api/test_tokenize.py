"""/tokenize and /detokenize agree with what the generation routes run; /v1/models names the model."""

import httpx
import pytest

pytestmark = pytest.mark.timeout(60)


def test_tokenize_matches_the_generation_routes(tiny_engine, start_server):
    url, _ = start_server(tiny_engine, system_prompt="Be brief.")
    client = httpx.Client(base_url=url)
    tokens = client.post("/tokenize", json={"prompt": "hello there"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == tiny_engine.max_model_len
    usage = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == tokens["count"]
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hello there"}
    # messages are rendered as the chat route renders them, the server's system prompt included
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    usage = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    text = client.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "Be brief." in text and "hi" in text
    (model,) = client.get("/v1/models").json()["data"]
    assert model["id"] == "test-model" and model["max_model_len"] == tiny_engine.max_model_len


def test_tokenize_counts_the_tools_as_chat_puts_them_in_the_prompt(long_engine, start_server):
    url, _ = start_server(long_engine)
    client = httpx.Client(base_url=url)
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "ping", "description": "Ping a host."}}]
    plain = client.post("/tokenize", json={"messages": messages}).json()
    with_tools = client.post("/tokenize", json={"messages": messages, "tools": tools}).json()
    body = {"messages": messages, "tools": tools, "max_tokens": 1}
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == with_tools["count"] > plain["count"]
    assert (
        "Ping a host." in client.post("/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    )
