"""The embedded default model on its quantized path (its GGUF's Q4_1 blocks, Q8_0 embedding): what it holds,
how close it stays to float32, and that its answers still hold."""

import pytest

from model import cpu_tier
from server.bench.offline import DEFAULT_QUALITY_TEXT, bench_quality
from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import SamplingParams
from tests.helpers.engine_runs import alone, run

pytestmark = pytest.mark.slow


def linears(engine: Engine) -> list:
    from model.linear import Linear

    return [m for m in engine.runner.model.modules() if isinstance(m, Linear)]


@pytest.fixture(scope="module")
def quantized(default_model_dir) -> Engine:
    return Engine(str(default_model_dir), EngineConfig(kv_cache_memory=256 << 20, max_num_seqs=4))


@pytest.mark.timeout(120)
def test_the_default_model_is_served_from_its_quantized_weights(quantized):
    from model.linear import Linear

    model = quantized.runner.model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert {m.bits for name, m in linears.items() if name.startswith("layers.")} == {4}  # the GGUF's Q4_1
    assert model.lm_head.bits == 8 and model.embed is model.lm_head  # Q8_0, tied
    assert model.layer_stack is not None  # the blocks run as one C++ call (model/layer_stack.py)
    held = {
        t.data_ptr(): t.numel() * t.element_size()
        for t in [*model.parameters(), *model.buffers()]
        if not t.is_meta
    }
    assert sum(held.values()) < 110e6  # bytes of weights resident (bf16 dense: ~270 MB plus oneDNN's copies)


@pytest.mark.timeout(600)
def test_quality_against_float32_with_the_same_weights(quantized, default_model_dir):
    """The default's targets: llama.cpp's distance from float32 on this very file, where the quantized GEMMs
    round their activations to int8 per 32 as llama.cpp does (the avx512bf16 and avx2 tiers; llama.cpp b11312's
    llama-perplexity measures 0.0027 mean KL divergence and 96.5% top-1 agreement against the file's values in
    float32, over the second halves of 512-token windows): mean KL <= 0.005 and top-1 >= 95% on the shipped
    text, perplexity within 1%, the France question answered about France; and a prompt's greedy tokens the same
    alone and beside others. Its first token is a near-tie in float32 ("The" 0.12 logits above "L'"), which 8-bit
    activations may tip: llama.cpp b11312 answers "L'Étoile, la Marseillaise, ..." from this file (both its builds),
    the avx2 tier "L'Étoile, la Cité, la France", the avx512bf16 tier Paris; the wide test below holds Paris."""
    reference = Engine(
        str(default_model_dir),
        EngineConfig(kv_cache_memory=256 << 20, max_num_seqs=4, dtype="float32", quantization="none"),
    )
    result = bench_quality(quantized, reference, DEFAULT_QUALITY_TEXT.read_text(), window=512)
    print(result)
    assert result["tokens"] > 2500
    assert result["mean_kld"] <= 0.005 and result["top1_agreement"] >= 0.95
    assert abs(result["perplexity"] / result["reference_perplexity"] - 1) < 0.01
    assert "France" in result["france"]
    int8 = {getattr(m.method, "int8_activations", False) for m in linears(quantized) if m.bits}
    assert int8 == {cpu_tier.select("auto")[0].name in ("avx512bf16", "avx2")}  # the tiers with the kernel
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {
        f"p{i}": quantized.tokenizer.encode(f"Question {i}: what is {i} + {i}? Answer:") for i in range(4)
    }
    assert run(quantized, prompts, params) == alone(quantized, prompts, params)


@pytest.mark.timeout(600)
def test_wide_activations_stay_closer_to_float32(default_model_dir):
    """--gemm-activations wide keeps each tier's own activations (bfloat16 pairs with AVX512-BF16, int16 per 32
    with AVX2 and AMX): measured 0.00058 mean KL divergence and 98.3% top-1 agreement with bfloat16, against
    int8's 0.0035 and 95.8%; the targets are 0.001 and 98%."""

    def engine(**kw) -> Engine:
        return Engine(str(default_model_dir), EngineConfig(kv_cache_memory=256 << 20, max_num_seqs=4, **kw))

    wide = engine(gemm_activations="wide")
    assert not any(getattr(m.method, "int8_activations", False) for m in linears(wide))
    reference = engine(dtype="float32", quantization="none")
    result = bench_quality(wide, reference, DEFAULT_QUALITY_TEXT.read_text(), window=512)
    print(result)
    assert result["mean_kld"] <= 0.001 and result["top1_agreement"] >= 0.98
    assert abs(result["perplexity"] / result["reference_perplexity"] - 1) < 0.005
    assert "Paris" in result["france"]
