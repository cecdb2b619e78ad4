"""The converted default model against transformers' LlamaForCausalLM on the same folder (float32)."""

import pytest
import torch

from model.kv_cache import KVCache
from model.loader import load_model
from model.tokenizer import Tokenizer
from tests.helpers.tiny_models import cache_blocks

pytestmark = pytest.mark.slow

CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant. Answer in one short paragraph."},
    {
        "role": "user",
        "content": "Explain why the sky looks blue during the day and red at sunset, in simple words. "
        "Then say, in one sentence, what would change if the Earth had no atmosphere at all, and why.",
    },
]


@pytest.fixture(scope="module")
def reference(default_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(default_model_dir):
    """The model in float32, once with each CPU path (its RMSNorm is chosen at construction)."""
    from model.kernels import cpu_kernels
    from model.linear import PlainLinear
    from model.transformer import Ops

    return {
        "cpp": load_model(
            default_model_dir, torch.float32, ops=Ops.with_kernels(PlainLinear(), cpu_kernels())
        ),
        "torch": load_model(default_model_dir, torch.float32),
    }


@pytest.mark.timeout(300)
def test_logits_match_transformers_on_a_chat_prompt(default_model_dir, reference, ours, cpu_path):
    model, config = ours["cpp" if cpu_path.kernels else "torch"]
    tok = Tokenizer.from_dir(default_model_dir)
    ids = tok.encode(tok.apply_chat_template(CONVERSATION))
    assert len(ids) >= 64
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    got = cpu_path.run(
        model, KVCache(config, cache_blocks(config, 16), 16, torch.float32, "cpu"), ids, 0, list(range(16))
    )
    diff = (got - ref).abs().max().item()
    print(f"max abs logit diff over {len(ids)} positions: {diff:.2e}")
    assert diff < 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.timeout(300)
def test_32_greedy_tokens_match_transformers(default_model_dir, reference, ours, cpu_path):
    model, config = ours["cpp" if cpu_path.kernels else "torch"]
    tok = Tokenizer.from_dir(default_model_dir)
    ids = tok.encode(tok.apply_chat_template(CONVERSATION))
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32
        )
    expected = expected[0, len(ids) :].tolist()
    cache = KVCache(config, cache_blocks(config, 16), 16, torch.float32, "cpu")
    seq = list(ids)
    logits = cpu_path.run(model, cache, seq, 0, list(range(16)))
    for _ in range(32):
        seq.append(int(logits[-1].argmax()))
        logits = cpu_path.run(model, cache, seq, len(seq) - 1, list(range(16)))
    assert seq[len(ids) :] == expected


@pytest.mark.timeout(300)
def test_default_model_knows_the_capital_of_france(default_model_dir):
    from server.engine.config import EngineConfig
    from server.engine.engine import Engine
    from server.engine.request import SamplingParams

    # float32, and the quantized GEMMs' activations as wide as the tier takes them: the answer's first token is a
    # near-tie in float32 ("The" 0.12 logits above "L'"), which int8 activations (AVX2's default) tip
    config = EngineConfig(kv_cache_memory=64 << 20, dtype="float32", gemm_activations="wide")
    engine = Engine(str(default_model_dir), config)
    tok = engine.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    engine.add_request("q", prompt, SamplingParams(max_tokens=32, temperature=0.0))
    text = ""
    while engine.has_work():
        text += "".join(o.text for o in engine.step())
    assert "Paris" in text
