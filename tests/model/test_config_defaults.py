"""Configs as transformers 4.57's save_pretrained writes them: PretrainedConfig.to_diff_dict leaves a key out when
its value is both PretrainedConfig's default and the config class's (tie_word_embeddings of a tied Gemma 2, Gemma 3
or SmolLM3), and transformers reads it back as the class's default. kvserve reads what is absent the same way,
from model/families.py's `config_defaults`."""

import json

import pytest
import torch

from model.config import KEY_ALIASES, ModelConfig
from model.families import FAMILIES
from model.kv_cache import KVCache
from tests.helpers.tiny_models import (
    ARCHITECTURES,
    CpuPath,
    build_tiny_model,
    cache_blocks,
    forward_sequence,
    reference_model,
    tiny_config,
)

# PretrainedConfig defaults of transformers 4.57 that 5.x left to each model's class: 4.57 wrote none of these
# where the class kept the same default (5.x's base, which lacks them, would write them all)
V4_BASE_DEFAULTS = {
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
PROMPT = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(0)).tolist()


def config_class(arch: str):
    import transformers

    return getattr(transformers, ARCHITECTURES[arch]).config_class  # Gemma3ForCausalLM's: Gemma3TextConfig


def as_v4_writes(config: dict, cls) -> dict:
    """config.json as transformers 4.57's PretrainedConfig.to_diff_dict writes it."""
    import transformers

    base = transformers.PretrainedConfig().to_dict() | V4_BASE_DEFAULTS
    ours = cls().to_dict()
    return {
        k: v
        for k, v in config.items()
        if k not in base or k == "transformers_version" or v != base[k] or v != ours.get(k, v)
    }


def without_class_defaults(config: dict, cls) -> dict:
    """config.json without every key whose value is the class's default: each key kvserve reads, left out."""
    ours = cls().to_dict()
    return {k: v for k, v in config.items() if k == "architectures" or k not in ours or v != ours[k]}


def dims_only(arch: str):
    """A tiny config that sets the model's dims and leaves every other key at the class's default."""
    cls = config_class(arch)
    if arch == "gpt2":
        return cls(n_embd=64, n_layer=2, n_head=4, vocab_size=300)
    return cls(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=300
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sparse", [as_v4_writes, without_class_defaults])
# dims_only: every other key at the class's default; tiny_model: tests/helpers/tiny_models.py's values
@pytest.mark.parametrize("variant", ["dims_only", "tiny_model"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_key_left_out_reads_as_the_class_default(arch, variant, sparse):
    cfg = dims_only(arch) if variant == "dims_only" else tiny_config(arch)
    cfg.architectures = [ARCHITECTURES[arch]]
    full = cfg.to_dict()
    left_out = sorted(set(full) - set(sparse(full, type(cfg))))
    assert ModelConfig.from_dict(full) == ModelConfig.from_dict(sparse(full, type(cfg))), left_out


def class_default(cls, key: str):
    """The class's default for a key, reading transformers 5's rope_parameters as 4.x's rope keys."""
    defaults = cls().to_dict()
    if key in defaults:
        return defaults[key]
    spelled = [alias for alias, name in KEY_ALIASES.items() if name == key and alias in defaults]
    if spelled:  # the class's own spelling of the key (num_local_experts for num_experts)
        return defaults[spelled[0]]
    rope = defaults["rope_parameters"]
    if key == "rope_local_base_freq":  # Gemma 3's sliding layers
        return rope["sliding_attention"]["rope_theta"]
    assert key == "rope_theta", key
    return rope.get("full_attention", rope)["rope_theta"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_table_holds_transformers_defaults(arch):
    """Each default in model/families.py is its transformers class's, also those no tiny config above reaches
    (max_window_layers, where no layer slides)."""
    cls = config_class(arch)
    for key, value in FAMILIES[ARCHITECTURES[arch]].config_defaults.items():
        assert class_default(cls, key) == value, (cls.__name__, key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "smollm3"])
def test_a_tied_model_saved_by_457_loads_as_transformers_loads_it(tmp_path, arch):
    """Tied, as these classes are by default, so 4.57 wrote no tie_word_embeddings: kvserve once read it as
    untied and refused the checkpoint for its missing lm_head.weight."""
    path = build_tiny_model(tmp_path, arch)
    config_file = path / "config.json"
    written = as_v4_writes(json.loads(config_file.read_text()), config_class(arch))
    assert "tie_word_embeddings" not in written
    config_file.write_text(json.dumps(written))

    model, config = CpuPath(kernels=False).load(path)
    assert config.tie_word_embeddings
    ours = forward_sequence(
        model, KVCache(config, cache_blocks(config, 64), 4, torch.float32, "cpu"), PROMPT, 0, list(range(16))
    )
    reference = reference_model(path)
    with torch.no_grad():
        ref = reference(torch.tensor([PROMPT])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spelling", ["num_experts", "num_local_experts"])
def test_the_expert_count_reads_the_same_in_either_spelling(spelling):
    """Qwen3-30B-A3B's config.json says num_experts; transformers 5 writes the class's num_local_experts."""
    cfg = dims_only("qwen3moe").to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    cfg = {k: v for k, v in cfg.items() if k not in KEY_ALIASES and k not in KEY_ALIASES.values()}
    assert ModelConfig.from_dict(cfg | {spelling: 16}).moe.num_experts == 16
    assert ModelConfig.from_dict(cfg).moe.num_experts == 128  # the class's default


@pytest.mark.timeout(30)
def test_rope_in_4x_spelling_is_not_overridden_by_the_5x_default():
    """GPT-OSS's class default is transformers 5's rope_parameters (YaRN x32 from 4096, base 150000); a config in
    4.x's spelling (rope_theta, rope_scaling: what a GGUF becomes) keeps its own."""
    cfg = dict(architectures=["GptOssForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
               rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "original_max_position_embeddings": 64})  # fmt: skip
    rope = ModelConfig.from_dict(cfg).layers[0].rope
    assert rope.theta == 10000.0 and dict(rope.scaling)["factor"] == 4.0
    default = ModelConfig.from_dict({k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")})
    assert default.layers[0].rope.theta == 150000.0 and dict(default.layers[0].rope.scaling)["factor"] == 32.0
