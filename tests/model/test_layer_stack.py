"""The decoder layers as one C++ call (model/layer_stack.py): the same bits as the Python loop, and only where
it covers the model."""

import dataclasses

import pytest
import torch

from model.attention_cpu import CpuKernelAttention
from model.kernels import cpu_kernels
from model.kv_cache import KVCache
from model.linear import PlainLinear
from model.loader import load_model
from model.quant import QuantizedLinear
from model.transformer import Ops

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels could not be built here")


def load(
    path, bits: int | None, stack: bool = True, kernels=None, dtype=torch.bfloat16, quantized: bool = False
):
    """quantized: the checkpoint's own quantized weights, as they are (bits None: nothing quantized at load)."""
    kernels = kernels or cpu_kernels()
    linear = QuantizedLinear(kernels, PlainLinear(), bits) if bits or quantized else PlainLinear()
    ops = Ops.with_kernels(linear, kernels)
    if not stack:
        ops = dataclasses.replace(ops, layer_stack=None)
    return load_model(path, dtype, "cpu", ops)


def mixed_step(model, config, kernels=None, dtype=torch.bfloat16):
    """One step of three sequences: a prompt's first chunk, a later chunk of another and a decode, over a cache
    holding earlier K/V (the same random ones on every call). Returns the hidden states and the cache."""
    cache = KVCache(config, num_blocks=16, block_size=16, dtype=torch.bfloat16, device="cpu")  # every tier's
    g = torch.Generator().manual_seed(0)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    attention = CpuKernelAttention(kernels or cpu_kernels(), block_size=16)
    query_lens, seq_lens = [20, 9, 1], [20, 41, 37]
    positions, meta = attention.build(query_lens, seq_lens, [[1, 2], [3, 4, 5], [6, 7, 8]])
    ids = torch.randint(3, config.vocab_size, (sum(query_lens),), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        hidden = model(ids, positions, meta, cache)
    return hidden, cache


# qwen2: q/k/v biases, an untied LM head; mistral: a sliding window shorter than the sequences; qwen3: q/k norms
# per head; gemma2: sandwich norms, GeGLU, attention soft-cap, windowed and full layers; gemma3: q/k norms and
# two rotary tables too (local and global theta)
ARCHS = [
    ("llama", {}),
    ("qwen2", {}),
    ("mistral", {"sliding_window": 8}),
    ("qwen3", {}),
    ("gemma2", {"sliding_window": 8}),
    ("gemma3", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
]


@pytest.mark.parametrize("arch,overrides", ARCHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_stack_gives_the_loops_bits(tiny_model_factory, tier_kernels, arch, overrides, bits, dtype):
    path = tiny_model_factory(arch, **overrides)
    stacked, config = load(path, bits, kernels=tier_kernels, dtype=dtype)
    looped, _ = load(path, bits, stack=False, kernels=tier_kernels, dtype=dtype)
    assert stacked.layer_stack is not None and looped.layer_stack is None
    a, cache_a = mixed_step(stacked, config, tier_kernels, dtype)
    b, cache_b = mixed_step(looped, config, tier_kernels, dtype)
    assert torch.equal(a, b)
    assert torch.equal(cache_a.k, cache_b.k) and torch.equal(cache_a.v, cache_b.v)  # the same K/V written
    assert a.abs().sum() > 0


def test_gemma3s_layers_differ_as_the_stack_is_told():
    """The gemma3 case above tests what it says: a windowed layer and a full one, with different rotary tables."""
    from model.config import ModelConfig

    overrides = dict(ARCHS)["gemma3"]
    config = ModelConfig.from_dict({"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
                                    "rope_theta": 1e6, "rope_local_base_freq": 1e4, **overrides})  # fmt: skip
    windows, ropes = [spec.window for spec in config.layers], {spec.rope for spec in config.layers}
    assert windows == [8, None] and len(ropes) == 2


def test_the_stack_only_covers_quantized_llama_style_blocks(tiny_model_factory):
    assert load(tiny_model_factory("llama"), bits=None)[0].layer_stack is None  # dense bfloat16 GEMMs
    assert load(tiny_model_factory("gpt2"), bits=8)[0].layer_stack is None  # LayerNorm, GELU
    assert load(tiny_model_factory("olmo2"), bits=8)[0].layer_stack is None  # norms after branches only
    granite = tiny_model_factory("granite", residual_multiplier=0.5)
    assert load(granite, bits=8)[0].layer_stack is None  # residual scalars
