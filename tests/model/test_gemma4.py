"""Gemma 4's text model: full-attention layers with heads of their own (wider, fewer, keys as values) beside the
sliding layers', in one paged KV cache; its config in both dialects; what is not served yet, refused by name.
(The logits against transformers, batch invariance and quantized runs are test_families.py's, as every family's.)"""

import json

import pytest
import torch

from model.config import ModelConfig, UnsupportedModelError
from model.kv_cache import KVCache
from tests.helpers.tiny_models import (
    FAMILY_OVERRIDES,
    CpuPath,
    cache_blocks,
    save_tiny_tokenizer,
    tiny_config,
    tokens_together_and_alone,
)

PROMPT = torch.randint(3, 300, (21,), generator=torch.Generator().manual_seed(4)).tolist()


def hub_config(**overrides) -> dict:
    """A Gemma 4 31B-shaped config.json as the hub has it: global_head_dim and num_global_key_value_heads, no
    per_layer_config (which transformers writes in their place)."""
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 60,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 4,
        "attention_k_eq_v": True,
        "sliding_window": 1024,
        "hidden_size_per_layer_input": 0,
        "final_logit_softcapping": 30.0,
        "vocab_size": 262144,
        "max_position_embeddings": 262144,
        "layer_types": pattern * 10,
    } | overrides


def test_the_full_layers_heads_are_their_own():
    config = ModelConfig.from_dict(hub_config())
    full, sliding = config.layers[5], config.layers[0]
    assert (full.head_dim, full.num_kv_heads, full.k_eq_v, full.window) == (512, 4, True, None)
    assert config.kv_shape(sliding) == (16, 256) and sliding.window == 1024 and not sliding.k_eq_v
    # the full layers' RoPE turns a quarter of a 512-wide head's pairs (theta 1e6), the sliding layers' all of theirs
    assert (full.rope.dim, full.rope.kind, dict(full.rope.scaling)["partial_rotary_factor"]) == (
        512,
        "proportional",
        0.25,
    )
    assert (sliding.rope.dim, sliding.rope.theta) == (256, 10000.0)
    assert config.attention_scale == 1.0 and config.final_softcap == 30.0 and config.per_layer_input_size == 0
    # 10 full layers and 50 sliding ones in pages of 5 rows, each as wide as a sliding layer's 16 x 256: the full
    # layers (4 x 512) two to a row, one group; the sliding layers ten groups of 5
    shapes = [(g.window, g.num_kv_heads, g.head_dim, len(g.layers), g.per_row) for g in config.kv_groups]
    assert shapes == [(None, 4, 512, 10, 2)] + [(1024, 16, 256, 5, 1)] * 10
    assert not config.uniform_kv and config.kv_width == 16 * 256 and config.kv_page_rows == 5
    # a token in every group (within the window) takes exactly its layers' K/V: 880 KiB in bfloat16
    per_block = KVCache.bytes_per_block(config, 16, torch.bfloat16)
    exact = 2 * 2 * (50 * 16 * 256 + 10 * 4 * 512)
    assert len(config.kv_groups) * per_block // 16 == exact == 880 * 1024


def test_the_last_layers_read_an_earlier_layers_cache():
    """E2B's shape: 35 layers, the last 20 without K/V of their own, each reading the last of the first 15 of its
    kind, with MLPs twice as wide; they take no rows of the cache's pages."""
    pattern = ["sliding_attention"] * 4 + ["full_attention"]
    config = ModelConfig.from_dict(
        hub_config(
            hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
            num_key_value_heads=1, attention_k_eq_v=False, sliding_window=512, hidden_size_per_layer_input=256,
            num_kv_shared_layers=20, use_double_wide_mlp=True, layer_types=pattern * 7,
        )
    )  # fmt: skip
    assert config.per_layer_input_size == 256 and config.per_layer_vocab_size == 262144
    sources = {i: spec.kv_source for i, spec in enumerate(config.layers) if spec.kv_source >= 0}
    assert sorted(sources) == list(range(15, 35))
    assert all(sources[i] == (14 if config.layers[i].window is None else 13) for i in sources)
    assert {config.layers[i].intermediate_size for i in sources} == {2 * 6144}
    assert config.layers[0].intermediate_size == 0  # the model's
    assert sum(len(g.layers) for g in config.kv_groups) == 15
    assert all(config.kv_rows[i] == config.kv_rows[sources[i]] for i in sources)
    cache = KVCache(config, 4, 16, torch.bfloat16, "cpu")
    assert all(cache.layer(i)[0].data_ptr() == cache.layer(sources[i])[0].data_ptr() for i in sources)
    # the full layers' 1 KV head of 512 beside the sliding layers' 1 of 256: two sliding layers to a row
    assert [(g.window, len(g.layers), g.per_row) for g in config.kv_groups] == [(None, 3, 1)] + [
        (512, 6, 2)
    ] * 2


def test_26b_a4bs_layers_are_dense_and_sparse_side_by_side():
    config = ModelConfig.from_dict(
        hub_config(
            hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
            num_key_value_heads=8, num_global_key_value_heads=2, enable_moe_block=True, num_experts=128,
            top_k_experts=8, moe_intermediate_size=704, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
        )
    )  # fmt: skip
    assert {spec.ffn for spec in config.layers} == {"dense_and_moe"}
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize, moe.scaled_router) == (
        128, 8, 704, True, True
    )  # fmt: skip
    assert config.kv_shape(config.layers[5]) == (2, 512) and config.kv_shape(config.layers[0]) == (8, 256)
    assert not ModelConfig.from_dict(hub_config()).moe  # 31B: dense


def test_the_hub_config_and_the_one_transformers_writes_read_the_same(tmp_path):
    """transformers reads global_head_dim and num_global_key_value_heads into per_layer_config, and writes that."""
    import transformers

    hub = hub_config(num_hidden_layers=12, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2)
    written = transformers.Gemma4TextConfig(
        **{k: v for k, v in hub.items() if k != "architectures"}
    ).to_dict()
    assert "global_head_dim" not in written and "per_layer_config" in written
    assert ModelConfig.from_dict(written | {"architectures": hub["architectures"]}) == ModelConfig.from_dict(
        hub
    )


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("num_kv_shared_layers", 60, "shares the KV cache of no earlier"),
        ("use_bidirectional_attention", "all", "bidirectional"),
    ],
)
def test_what_is_not_served_yet_is_refused_by_name(key, value, named):
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_dict(hub_config(**{key: value}))


def test_each_page_is_the_same_memory_whichever_group_holds_it():
    """A page freed by a sliding group may next hold a full layer's keys: both kinds' views of a page must cover
    the same bytes, and nothing of another page."""
    config = ModelConfig.from_dict(
        hub_config(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    )
    block_size, blocks = 4, 6
    cache = KVCache(config, blocks, block_size, torch.float32, "cpu")
    full, sliding = cache.layer(5)[0], cache.layer(0)[0]
    assert full.shape == (4, blocks * block_size, 512) and sliding.shape == (16, blocks * block_size, 256)
    assert cache.k.shape == (1, blocks * block_size, 16 * 256)
    page = slice(2 * block_size, 3 * block_size)
    full[:, page] = 1.0  # page 2, written as a full layer's
    touched = sliding.count_nonzero(dim=(0, 2))  # per slot, as a sliding layer reads it
    assert touched[page].tolist() == [4 * 512] * block_size  # the first half of each slot's values
    assert touched.sum() == touched[page].sum()  # no other page
    per_block = KVCache.bytes_per_block(config, block_size, torch.float32)
    assert per_block == cache.k.numel() * 4 * 2 // blocks


@pytest.mark.timeout(120)
def test_a_multimodal_checkpoints_text_model_matches_transformers(tmp_path):
    """Gemma 4's checkpoints are Gemma4ForConditionalGeneration's: the text model under model.language_model, its
    config under text_config, a vision tower kvserve leaves unread."""
    import transformers

    text = tiny_config("gemma4", **FAMILY_OVERRIDES["gemma4"])
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16,
    )  # fmt: skip
    config = transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None
    )
    config.architectures = ["Gemma4ForConditionalGeneration"]
    torch.manual_seed(0)
    reference = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in reference.parameters():  # as build_tiny_model spreads them
            if p.dim() > 1:
                p.normal_(0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in reference.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
        for name, p in reference.named_parameters():
            if name.endswith("q_norm.weight"):
                p.mul_(p.shape[0] ** -0.5)
    reference.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "Gemma4ForConditionalGeneration"
    ]

    path = CpuPath(kernels=True)
    model, ours_config = path.load(tmp_path)
    assert ours_config.architecture == "Gemma4ForCausalLM"
    cache = KVCache(ours_config, cache_blocks(ours_config, 64), 4, torch.float32, "cpu")
    ours = path.run(model, cache, PROMPT, 0, list(range(16)))
    with torch.no_grad():
        ref = reference(torch.tensor([PROMPT])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


# 26B-A4B's shape in small: every layer's FFN a dense MLP beside 8 experts (2 a token), with Gemma 4's scaled router
MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)


def tiny_moe_model(path, seed: int = 0):
    """A tiny random Gemma 4 with 26B-A4B's FFNs, its scales and norms away from their init so that each shows."""
    import transformers

    config = tiny_config("gemma4", **(FAMILY_OVERRIDES["gemma4"] | MOE))
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            elif name.endswith("per_expert_scale"):
                p.uniform_(0.5, 1.5)
            else:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("q_norm.weight"):
                p.mul_(p.shape[0] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["kernels", "pytorch", "gpu"])
def test_the_moe_layers_match_transformers(tmp_path, path, request):
    """The dense MLP and the experts side by side: the router reads the stream (rms-normed, scaled), the experts
    its own norm, each chosen expert's weight times its per-expert scale. On each CPU path, and on a GPU's ops run
    here (the Triton attention and grouped experts under Triton's interpreter)."""
    if path == "gpu":
        request.getfixturevalue("triton_here")
    reference = tiny_moe_model(tmp_path)
    path = CpuPath(kernels=path == "kernels", gpu_attention="triton" if path == "gpu" else None)
    model, config = path.load(tmp_path)
    assert {spec.ffn for spec in config.layers} == {"dense_and_moe"} and config.moe.scaled_router
    assert all(
        (layer.mlp.moe.grouped is not None) == (path.gpu_attention is not None) for layer in model.layers
    )
    cache = KVCache(config, cache_blocks(config, 64), 4, torch.float32, "cpu")
    ours = path.run(model, cache, PROMPT, 0, list(range(16)))
    with torch.no_grad():
        ref = reference(torch.tensor([PROMPT])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernels", ["on", "off"])
def test_the_moe_layers_tokens_do_not_depend_on_their_batch(tmp_path, kernels):
    """Six prompts together through the engine (prefill chunks beside decodes, past the window) give each one's
    greedy tokens alone: a token's experts and sums never depend on what shares its step."""
    tiny_moe_model(tmp_path)
    together, alone = tokens_together_and_alone(tmp_path, kernels)
    assert together == alone


def test_the_tiny_model_packs_two_sliding_layers_to_a_row():
    """test_families' Gemma 4 (logits against transformers, batched == alone) runs its two sliding layers (2 KV
    heads of 16) side by side in a row as wide as a full layer's 1 head of 64: the packing, exercised there."""
    config = tiny_config("gemma4", **FAMILY_OVERRIDES["gemma4"]).to_dict() | {
        "architectures": ["Gemma4ForCausalLM"]
    }
    groups = ModelConfig.from_dict(config).kv_groups
    assert [(g.window, g.layers, g.per_row) for g in groups] == [(None, (1,), 1), (8, (0, 2), 2)]
