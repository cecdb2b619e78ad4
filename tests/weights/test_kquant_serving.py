"""A Q4_K_M-style GGUF (Q4_K, with Q6_K, Q5_0 and Q8_0 where llama.cpp's rules put them) served with its own
quantized weights: the K-quant blocks kept as they are, a fused layer of mixed formats kept in both, and the
logits those weights give in float32."""

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from model.kernels import cpu_kernels
from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import SamplingParams
from tests.helpers.gguf_blocks import HALVES
from tests.helpers.gguf_writers import add_vocab
from weights.gguf_source import GGUFSource

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 256, 4, 2, 512
HEAD_DIM = HIDDEN // HEADS
# GGUF name in blk.N -> (its type on layer 0, on layer 1): v and down in Q6_K on one layer (use_more_bits),
# layer 1's up in Q5_0 (a width fallback) beside a Q4_K gate, and one Q3_K, which no kernel keeps
TYPES = {
    "attn_q": ("Q4_K", "Q4_K"),
    "attn_k": ("Q4_K", "Q4_K"),
    "attn_v": ("Q6_K", "Q4_K"),
    "attn_output": ("Q4_K", "Q3_K"),
    "ffn_gate": ("Q4_K", "Q4_K"),
    "ffn_up": ("Q4_K", "Q5_0"),
    "ffn_down": ("Q6_K", "Q8_0"),
}
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
          "ffn_down": (HIDDEN, FFN)}  # fmt: skip
BLOCK = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q3_K": (256, 110)}


def weight_blocks(type_name: str, N: int, K: int, rng) -> np.ndarray:
    """Random blocks whose weights are about as large as a trained model's (|w| below ~0.1)."""
    size, nbytes = BLOCK[type_name]
    blocks = rng.integers(0, 256, (N, K // size, nbytes), dtype=np.uint8)
    # the largest integer each scale multiplies: sub-scale times q
    reach = {"Q4_K": 63 * 15, "Q6_K": 128 * 32, "Q5_0": 16, "Q8_0": 128, "Q3_K": 32 * 4}[type_name]
    for at in HALVES[type_name]:
        value = (rng.uniform(0.2, 1, (N, K // size)) * 0.08 / reach).astype(np.float16)
        blocks[..., at : at + 2] = value[..., None].view(np.uint8)
    return blocks.reshape(N, -1)


def write_kquant_gguf(path, vocab: dict, seed: int = 0, types: dict = TYPES) -> None:
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    for key, value in [("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("rope.dimension_count", HEAD_DIM),
                       ("vocab_size", len(vocab["tokens"]))]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    add_vocab(writer, vocab)
    vocab_size = len(vocab["tokens"])

    def add(name: str, type_name: str, N: int, K: int) -> None:
        qtype = GGMLQuantizationType[type_name]
        writer.add_tensor(name, weight_blocks(type_name, N, K, rng), raw_dtype=qtype)

    add("token_embd.weight", "Q4_K", vocab_size, HIDDEN)
    add("output.weight", "Q6_K", vocab_size, HIDDEN)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(
                f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
            )
        for short, kinds in types.items():
            add(f"blk.{layer}.{short}.weight", kinds[layer], *SHAPES[short])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def engine_for(path, **config) -> Engine:
    """The GGUF at `path` served in place, as `kvserve serve --model FILE.gguf` does."""
    return Engine(GGUFSource(path), EngineConfig(kv_cache_memory=8 << 20, block_size=4, **config))


def greedy(engine: Engine, ids: list[int], n: int = 16) -> list[int]:
    engine.add_request("r", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tokens = []
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.timeout(300)
def test_a_kquant_gguf_computes_what_its_dequantized_weights_do(tmp_path, byte_vocab, caplog):
    from model.linear import Linear

    gguf = tmp_path / "tiny.gguf"
    write_kquant_gguf(gguf, byte_vocab)
    # float32 K/V too: the bfloat16 cache's rounding of slightly other K and V would hide the GEMMs' own error
    reference_engine = engine_for(gguf, quantization="none", dtype="float32", kv_cache_dtype="float32")
    ids = list(range(3, 60))
    reference = reference_engine.score(ids)
    reference_tokens = greedy(reference_engine, ids)
    # float32 as the tier multiplies it (--gemm-activations wide), then by default: rounded to int8 per 32 where
    # the engine does that to float32 (AVX2)
    runs = [("float32", "wide"), ("float32", "auto"), ("bfloat16", "auto")]
    for dtype, activations in runs:
        with caplog.at_level(logging.INFO):  # bfloat16 activations: a bfloat16 cache
            engine = engine_for(
                gguf,
                dtype=dtype,
                kv_cache_dtype="float32" if dtype == "float32" else "auto",
                gemm_activations=activations,
            )
        model = engine.runner.model
        kinds = {
            name: "+".join(m.kinds) for name, m in model.named_modules() if isinstance(m, Linear) and m.bits
        }
        assert kinds["layers.0.attn.qkv"] == "Q4_K+Q6_K" and kinds["layers.1.mlp.up"] == "Q4_K+Q5_0"
        assert kinds["layers.0.mlp.down"] == "Q6_K" and kinds["layers.1.mlp.down"] == "Q8_0"
        assert kinds["lm_head"] == "Q6_K" and kinds["embed"] == "Q4_K"
        assert "layers.1.attn.o" not in kinds  # Q3_K: dequantized, and the log says what it costs
        assert "dequantized at load (no kernel keeps these types quantized): Q3_K x 1 (" in (caplog.text)
        assert all(m.weight.is_meta for m in model.modules() if isinstance(m, Linear) and m.bits)
        scores = engine.score(ids)
        # float32: float32 sums of the exact weights, from float32 activations (measured 3e-6 on the generic
        # tier), int16 ones per 32 (AVX2's and AMX's, 1.4e-4); bfloat16 rounds each layer's input and K/V to 8
        # bits, and int8 activations (AVX2's default; measured 3.3e-2 on a Xeon run as avx2) each group's to 8
        int8 = any(
            getattr(m.method, "int8_activations", False) for m in model.modules() if isinstance(m, Linear)
        )
        exact = dtype == "float32" and not int8
        kernels = cpu_kernels()
        # int16 (AVX2's, 1.4e-4), or 11 to 12 bits where AMX's tiles take 4- and 5-bit weights' x (measured 4e-3)
        wide = (
            1e-2 if kernels.gemm_int16_narrow else {"float32": 2e-5, "int16": 1e-3}[kernels.gemm_float32_as]
        )
        tolerance = wide if exact else 0.05
        assert (scores - reference).abs().max() < tolerance * reference.abs().max(), (dtype, activations)
        assert (scores.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
        if exact:
            assert greedy(engine, ids) == reference_tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_layer_stack_runs_mixed_formats_with_the_loops_bits(tmp_path, byte_vocab, tier_kernels, dtype):
    """Every weight kept (Q3_K swapped for Q4_K): the blocks run as one C++ call, fused layers of two formats
    included, with the Python loop's bits."""
    from tests.model.test_layer_stack import load, mixed_step

    write_kquant_gguf(tmp_path / "tiny.gguf", byte_vocab, types=TYPES | {"attn_output": ("Q4_K", "Q4_K")})
    # bits=None: the file's own formats, nothing quantized at load
    gguf = tmp_path / "tiny.gguf"
    stacked, config = load(GGUFSource(gguf), None, kernels=tier_kernels, dtype=dtype, quantized=True)
    looped, _ = load(GGUFSource(gguf), None, stack=False, kernels=tier_kernels, dtype=dtype, quantized=True)
    assert stacked.layer_stack is not None and looped.layer_stack is None
    assert stacked.layers[0].attn.qkv.kinds == ["Q4_K", "Q6_K"]
    a, cache_a = mixed_step(stacked, config, tier_kernels, dtype)
    b, cache_b = mixed_step(looped, config, tier_kernels, dtype)
    assert torch.equal(a, b) and a.abs().sum() > 0
    assert torch.equal(cache_a.k, cache_b.k) and torch.equal(cache_a.v, cache_b.v)


@pytest.mark.timeout(300)
def test_dequantize_gguf_writes_the_float32_reference_llama_perplexity_compares_with(tmp_path, byte_vocab):
    """scripts/dequantize_gguf.py: the K-quant file's weights as float32, the metadata unchanged, so that
    llama.cpp's KL divergence of a file is measured against the same reference as `kvserve bench-quality`'s."""
    import subprocess
    import sys
    from pathlib import Path

    quantized, dequantized = tmp_path / "tiny.gguf", tmp_path / "tiny.F32.gguf"
    write_kquant_gguf(quantized, byte_vocab)
    script = Path(__file__).parents[2] / "scripts" / "dequantize_gguf.py"
    subprocess.run([sys.executable, str(script), str(quantized), str(dequantized)], check=True)
    assert not GGUFSource(dequantized).quantized and GGUFSource(quantized).quantized
    ids = list(range(3, 40))
    float32 = {"dtype": "float32", "kv_cache_dtype": "float32"}
    reference = engine_for(quantized, quantization="none", **float32).score(ids)
    assert torch.equal(engine_for(dequantized, **float32).score(ids), reference)
