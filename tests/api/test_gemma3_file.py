"""The real Gemma 3 270M file (base, Q4_K_M; architecture gemma3, 262k SentencePiece vocabulary, no chat
template) served as `kvserve serve --model FILE.gguf` serves it: greedy tokens equal to transformers' float32
run of the same file's dequantized weights, and answers through the completion and chat routes."""

import httpx
import pytest
import torch

from server.engine.async_engine import AsyncEngine
from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village", "東京は"]
# Gemma's turn format, for a chat route on a base model that has no template of its own
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def served(gemma3_gguf):
    """The file as `kvserve serve --model FILE.gguf` serves it: read in place."""
    from weights.gguf_source import GGUFSource

    return GGUFSource(gemma3_gguf)


@pytest.mark.timeout(900)
def test_greedy_tokens_equal_transformers_on_the_files_weights(gemma3_gguf):
    import transformers

    # float32 everywhere, every weight dequantized: what transformers computes from the file
    config = EngineConfig(
        kv_cache_memory=64 << 20, dtype="float32", kv_cache_dtype="float32", quantization="none"
    )
    engine = Engine(served(gemma3_gguf), config)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32
    ).eval()
    for i, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(prompt, add_special_tokens=True)
        assert ids[0] == 2  # <bos>
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
            )
        engine.add_request(f"p{i}", ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        tokens = []
        while engine.has_work():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
        assert tokens == out[0, len(ids) :].tolist(), prompt


@pytest.mark.timeout(600)
def test_completion_and_chat_routes_answer(gemma3_gguf, start_server):
    engines = [
        AsyncEngine(lambda t=template: Engine(served(gemma3_gguf), EngineConfig(kv_cache_memory=64 << 20), t))
        for template in (None, TEMPLATE)
    ]
    try:
        (plain, _), (templated, _) = (start_server(engine, served_model_name="gemma") for engine in engines)
        question = {"model": "gemma", "max_tokens": 24, "temperature": 0}
        r = httpx.post(
            f"{plain}/v1/completions", json={**question, "prompt": "What is the capital of France?"}
        )
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]
        chat = {**question, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        r = httpx.post(f"{plain}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        r = httpx.post(f"{templated}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].strip()
    finally:
        for engine in engines:
            engine.shutdown()
