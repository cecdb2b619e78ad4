"""System messages among the others (Claude Code sends one after the first user turn): rendered where they stand
by a template that can, folded into the user turns by one that cannot; the same through /v1/chat/completions'
messages and /v1/messages'."""

import anthropic
import httpx
import pytest

from server.api.prompt import fold_inline_system
from server.engine.async_engine import AsyncEngine
from server.engine.config import EngineConfig
from server.engine.engine import Engine

pytestmark = pytest.mark.timeout(120)

# Gemma's way, cut down: after an optional leading system message, roles must alternate
ALTERNATING = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
# The same conversation in both APIs' shapes: a system prompt, then system messages after a user turn, after an
# assistant turn and last.
CHAT = [
    {"role": "system", "content": "S0"},
    {"role": "user", "content": "Q1"},
    {"role": "system", "content": "R1"},
    {"role": "assistant", "content": "A1"},
    {"role": "system", "content": "R2"},
    {"role": "user", "content": "Q2"},
    {"role": "system", "content": [{"type": "text", "text": "R3"}]},
]
ANTHROPIC = {"model": "smollm2", "system": "S0", "messages": CHAT[1:]}


def test_fold_joins_each_to_a_user_turn():
    out = fold_inline_system([dict(m) for m in CHAT])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    texts = [
        [part["text"] for part in m["content"]] if m["role"] != "assistant" else m["content"] for m in out
    ]
    # to the user turn just before when nothing came between, else to the next one
    assert texts == [["S0"], ["Q1", "R1"], "A1", ["R2", "Q2", "R3"]]
    # leading ones joined; one with no user turn after it becomes one
    tail = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}, *CHAT[1:4], CHAT[4]]
    assert fold_inline_system(tail)[0]["content"] == [{"type": "text", "text": t} for t in "ab"]
    assert fold_inline_system(tail)[-1] == {"role": "user", "content": [{"type": "text", "text": "R2"}]}


@pytest.mark.slow
def test_rendered_where_they_stand(default_server):
    """SmolLM2's ChatML template renders a system turn anywhere: the prompt keeps the conversation's order."""
    client = httpx.Client(base_url=default_server)
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    turns = ["system\nS0", "user\nQ1", "system\nR1", "assistant\nA1", "system\nR2", "user\nQ2", "system\nR3"]
    expected = "".join(f"<|im_start|>{turn}<|im_end|>\n" for turn in turns) + "<|im_start|>assistant\n"
    assert chat["tokens"] == client.post("/tokenize", json={"prompt": expected}).json()["tokens"]
    # /v1/messages renders its own shape of it the same
    sdk = anthropic.Anthropic(base_url=default_server, api_key="unused", max_retries=0)
    assert sdk.messages.count_tokens(**ANTHROPIC).input_tokens == chat["count"]


def test_folded_where_the_template_refuses_them(tiny_llama_dir, start_server):
    engine = AsyncEngine(
        lambda: Engine(str(tiny_llama_dir), EngineConfig(kv_cache_memory=64 << 20), ALTERNATING)
    )
    try:
        url, _ = start_server(engine)
        client = httpx.Client(base_url=url)
        chat = client.post("/tokenize", json={"messages": CHAT}).json()
        text = client.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
        assert text == "<system>S0<user>Q1\nR1<assistant>A1<user>R2\nQ2\nR3<assistant>"
        sdk = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        body = {**ANTHROPIC, "model": "test-model"}
        assert sdk.messages.count_tokens(**body).input_tokens == chat["count"]
        reply = sdk.messages.create(**body, max_tokens=4)
        assert (
            reply.content and reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat["count"]
        )
    finally:
        engine.shutdown()
