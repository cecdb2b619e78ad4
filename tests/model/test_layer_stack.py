"""The decoder layers as one C++ call (model/layer_stack.py): the same bits as the Python loop, and only where
it covers the model."""

import dataclasses

import pytest
import torch

from model.attention_cpu import CpuKernelAttention
from model.deltanet import StepStates
from model.kernels import cpu_kernels
from model.kv_cache import KVCache
from model.layer_stack import covers
from model.linear import PlainLinear
from model.loader import load_model
from model.quant import QuantizedLinear
from model.transformer import Ops
from tests.helpers.tiny_models import ARCHES, tiny_family

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
    holding earlier K/V (and for a hybrid, earlier DeltaNet states: the same random ones on every call). Returns
    the hidden states and the cache."""
    num_groups = len(config.kv_groups)  # each KV group's blocks are its own: 9 each
    blocks = 9 * num_groups
    cache = KVCache(config, blocks, block_size=16, dtype=torch.bfloat16, device="cpu", num_state_slots=4)
    g = torch.Generator().manual_seed(0)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    states = None
    if config.linear_layers:  # the first sequence starts from zero in slot 3, the others from slots 0 and 1
        cache.conv.normal_(generator=g)
        cache.recurrent.normal_(std=0.1, generator=g)
        states = StepStates([0, 20, 29], [20, 9, 1], [3, 0, 1], [0, 32, 36])
    attention = CpuKernelAttention(kernels or cpu_kernels(), block_size=16)
    query_lens, seq_lens = [20, 9, 1], [20, 41, 37]
    tables = [[1, 2], [3, 4, 5], [6, 7, 8]]
    positions, meta = attention.build(
        query_lens, seq_lens, [[[b + 9 * g for b in t] for g in range(num_groups)] for t in tables]
    )
    ids = torch.randint(3, config.vocab_size, (sum(query_lens),), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        hidden = model(ids, positions, meta, cache, None, states)
    return hidden, cache


# every family of the table, as its tiny model in tests/model/test_families.py
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_stack_gives_the_loops_bits(tiny_model_factory, tier_kernels, arch, bits, dtype):
    """Where the C++ loop covers a family (model/layer_stack.py's covers), it gives the Python loop's bits and
    writes the same K/V; where it does not, no stack is built and the Python loop runs."""
    path = tiny_family(tiny_model_factory, arch)
    stacked, config = load(path, bits, kernels=tier_kernels, dtype=dtype)
    if not covers(config):
        assert stacked.layer_stack is None
        return
    looped, _ = load(path, bits, stack=False, kernels=tier_kernels, dtype=dtype)
    assert stacked.layer_stack is not None and looped.layer_stack is None
    a, cache_a = mixed_step(stacked, config, tier_kernels, dtype)
    b, cache_b = mixed_step(looped, config, tier_kernels, dtype)
    assert torch.equal(a, b)
    assert torch.equal(cache_a.k, cache_b.k) and torch.equal(cache_a.v, cache_b.v)  # the same K/V written
    if config.linear_layers:  # and the same DeltaNet states left
        assert torch.equal(cache_a.conv, cache_b.conv) and torch.equal(cache_a.recurrent, cache_b.recurrent)
    assert a.abs().sum() > 0


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_tiled_value_heads_give_the_loops_bits_and_their_own_states(tiny_model_factory, tier_kernels, arch):
    """A GGUF's Qwen3.5 value heads served as llama.cpp's files store them (each reads key head h % key heads,
    model/config.py's LinearAttentionSpec): the C++ loop gives the Python loop's bits there too, and the order is
    read (the same weights read grouped leave other states)."""
    from tests.helpers.tiny_models import FAMILY_OVERRIDES

    overrides = FAMILY_OVERRIDES.get(arch, {})
    tiled_path = tiny_model_factory(arch, **overrides, linear_value_heads_tiled=True)
    states = {}
    for name, path in (("tiled", tiled_path), ("grouped", tiny_family(tiny_model_factory, arch))):
        stacked, config = load(path, 4, kernels=tier_kernels, dtype=torch.float32)
        assert config.linear_attention.tiled_value_heads is (name == "tiled")
        looped, _ = load(path, 4, stack=False, kernels=tier_kernels, dtype=torch.float32)
        assert stacked.layer_stack is not None
        a, cache_a = mixed_step(stacked, config, tier_kernels, torch.float32)
        b, cache_b = mixed_step(looped, config, tier_kernels, torch.float32)
        assert torch.equal(a, b) and torch.equal(cache_a.recurrent, cache_b.recurrent)
        states[name] = cache_a.recurrent
    assert not torch.equal(states["tiled"], states["grouped"])


def test_every_field_of_the_config_is_placed_for_the_stack():
    """covers() is closed: each field of ModelConfig and LayerSpec says what the C++ loop computes of it, so a field
    added for a new family cannot be taken as covered unseen."""
    import dataclasses

    from model.config import LayerSpec, ModelConfig
    from model.layer_stack import CONFIG_FIELDS, LAYER_FIELDS

    assert set(CONFIG_FIELDS) == {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(LAYER_FIELDS) == {f.name for f in dataclasses.fields(LayerSpec)}


def test_gemma3s_layers_differ_as_the_stack_is_told(tiny_model_factory):
    """The gemma3 case above tests what it says: windowed layers and full ones, with different rotary tables."""
    from model.config import ModelConfig

    config = ModelConfig.from_dir(tiny_family(tiny_model_factory, "gemma3"))
    windows, ropes = {spec.window for spec in config.layers}, {spec.rope for spec in config.layers}
    assert windows == {8, None} and len(ropes) == 2 and covers(config)


def test_gpt_oss_runs_in_the_stack(tiny_model_factory):
    """GPT-OSS's sinks, windows, biased router and experts and clamped SwiGLU are all the loop's (the case above
    then compares its bits with the Python loop's), its experts as one C++ MoE FFN a layer."""
    model, config = load(tiny_family(tiny_model_factory, "gpt_oss"), bits=8)
    assert config.attn_sinks and config.mlp == "clamped_swiglu" and covers(config)
    assert model.layer_stack is not None
    assert all(block.mlp.fused is not None for block in model.layers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma4_runs_in_the_stack(tiny_model_factory, tmp_path, tier_kernels, dtype):
    """Gemma 4's blocks are all the loop's: the tiny family of the case above (per-layer inputs and layer scalars,
    full layers of their own heads with keys as values and normed values, sliding layers two to a row of the cache,
    the last layers reading an earlier one's K/V) and 26B-A4B's FFNs in small (a dense MLP beside the experts, one
    C++ MoE FFN a layer, its router reading the stream), each giving the Python loop's bits."""
    from tests.model.test_gemma4 import tiny_moe_model

    tiny_moe_model(tmp_path)
    for path in (tiny_family(tiny_model_factory, "gemma4"), tmp_path):
        stacked, config = load(path, 4, kernels=tier_kernels, dtype=dtype)
        looped, _ = load(path, 4, stack=False, kernels=tier_kernels, dtype=dtype)
        assert covers(config) and stacked.layer_stack is not None and config.per_layer_input_size
        assert any(spec.kv_source >= 0 for spec in config.layers) and not config.uniform_kv
        a, cache_a = mixed_step(stacked, config, tier_kernels, dtype)
        b, cache_b = mixed_step(looped, config, tier_kernels, dtype)
        assert torch.equal(a, b) and torch.equal(cache_a.k, cache_b.k) and torch.equal(cache_a.v, cache_b.v)
    assert all(block.mlp.moe.fused is not None for block in stacked.layers)


def test_the_stack_only_covers_quantized_llama_style_blocks(tiny_model_factory):
    assert load(tiny_model_factory("llama"), bits=None)[0].layer_stack is None  # dense bfloat16 GEMMs
    assert load(tiny_model_factory("gpt2"), bits=8)[0].layer_stack is None  # LayerNorm, GELU
    assert load(tiny_model_factory("olmo2"), bits=8)[0].layer_stack is None  # norms after branches only
    granite = tiny_model_factory("granite", residual_multiplier=0.5)
    assert load(granite, bits=8)[0].layer_stack is None  # residual scalars
