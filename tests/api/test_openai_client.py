"""The official openai client against a live server on the real default model."""

import httpx
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PIRATE = "You are a pirate. Answer every question in pirate speak, with arr and matey."


@pytest.fixture(scope="module")
def client(default_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_text(client, messages, **kw) -> str:
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0, **kw)
    return r.choices[0].message.content


def test_models(client):
    (model,) = client.models.list().data
    assert model.id == "smollm2" and model.object == "model"
    assert client.models.retrieve("smollm2") == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_streamed_and_not(client):
    kw = dict(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    r = client.completions.create(**kw)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "smollm2"
    (choice,) = r.choices
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == 5 and 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_chat_streamed_and_not_seeded(client):
    kw = dict(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0.8, seed=42)
    r = client.chat.completions.create(**kw)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    again = client.chat.completions.create(**kw)
    assert again.choices[0].message.content == r.choices[0].message.content  # the seed makes it reproducible
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_string(client):
    kw = dict(model="smollm2", prompt="Count: one, two, three,", max_tokens=12, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    r = client.completions.create(**kw, stop=[stop, "never appears"])
    assert r.choices[0].text == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_n2_choices_differ_and_reproduce(client):
    kw = dict(model="smollm2", messages=QUESTION, max_tokens=10, temperature=1.0, seed=7, n=2)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    texts = [c.message.content for c in r.choices]
    assert texts[0] != texts[1]
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == texts
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    completion = client.completions.create(model="smollm2", prompt="Once upon", max_tokens=6, n=2, seed=3)
    assert len(completion.choices) == 2 and completion.usage.prompt_tokens == 2


def test_errors_raise_the_clients_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    tool = {"type": "custom", "custom": {"name": "grep"}}  # OpenAI's free-form tools: not served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=1, tools=[tool])
    assert e.value.param.startswith("tools")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="x", max_tokens=100_000)
    assert "100000" in e.value.message


def test_a_system_prompt_changes_the_answer(client):
    plain = chat_text(client, QUESTION)
    pirate = chat_text(client, [{"role": "system", "content": PIRATE}, *QUESTION])
    assert plain != pirate


def test_a_developer_message_is_a_system_message(client):
    """OpenAI's newer clients send the system prompt with the role "developer"."""
    developer = chat_text(client, [{"role": "developer", "content": PIRATE}, *QUESTION])
    assert developer == chat_text(client, [{"role": "system", "content": PIRATE}, *QUESTION])
    assert developer != chat_text(client, QUESTION)


def test_the_configured_system_prompt_applies_when_the_request_has_none(default_engine, start_server, client):
    url, _ = start_server(default_engine, served_model_name="smollm2", system_prompt=PIRATE)
    configured = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    explicit = chat_text(client, [{"role": "system", "content": PIRATE}, *QUESTION])
    assert chat_text(configured, QUESTION) == explicit
    # a request's own system message wins over the configured one
    own = [{"role": "system", "content": "You are a helpful assistant."}, *QUESTION]
    assert chat_text(configured, own) == chat_text(client, own)


def test_logit_bias_forces_and_bans_tokens(client, default_server):
    (banana,) = httpx.post(f"{default_server}/tokenize", json={"prompt": " banana"}).json()["tokens"]
    kw = dict(model="smollm2", prompt="The capital of France is", temperature=0)
    forced = client.completions.create(**kw, max_tokens=3, logit_bias={str(banana): 100})
    assert forced.choices[0].text == " banana" * 3
    plain = client.completions.create(**kw, max_tokens=1).choices[0].text
    (first,) = httpx.post(f"{default_server}/tokenize", json={"prompt": plain}).json()["tokens"]
    banned = client.completions.create(**kw, max_tokens=1, logit_bias={str(first): -100})
    assert banned.choices[0].text != plain
