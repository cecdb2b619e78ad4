import pytest
import torch

from model import cpu_tier
from model.kv_cache import KVCache
from model.loader import WeightLoadError, load_model
from tests.helpers.tiny_models import cache_blocks

BLOCK = 4


def new_cache(config, dtype=torch.float32, num_blocks=64):
    return KVCache(config, cache_blocks(config, num_blocks), BLOCK, dtype, "cpu")


def reference_logits(model_dir, ids):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.timeout(120)
def test_llama3_rope_scaling_matches_transformers(tiny_model_factory, cpu_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    path = tiny_model_factory("llama", rope_scaling=scaling, rope_theta=500000.0)
    model, config = cpu_path.load(path)
    assert dict(config.layers[0].rope.scaling)["factor"] == 8.0
    ids = list(range(3, 103))
    ours = cpu_path.run(model, new_cache(config), ids, 0, list(range(32)))
    assert (ours - reference_logits(path, ids)).abs().max().item() < 1e-4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_causality_later_tokens_never_change_earlier_logits(tiny_model_factory, cpu_path, arch):
    model, config = cpu_path.load(tiny_model_factory(arch))
    ids = list(range(5, 35))
    changed = ids[:20] + [t + 7 for t in ids[20:]]
    a = cpu_path.run(model, new_cache(config), ids, 0, list(range(16)))
    b = cpu_path.run(model, new_cache(config), changed, 0, list(range(16)))
    assert torch.equal(a[:20], b[:20])
    assert not torch.equal(a[20:], b[20:])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_decode_equals_one_pass(tiny_model_factory, cpu_path, dtype):
    """N prompt tokens then M single-token decode steps give the logits of one forward over N+M tokens."""
    model, config = cpu_path.load(tiny_model_factory("llama"), dtype=dtype)
    ids = list(range(10, 60))
    N = 23
    table = [9, 3, 14, 0, 7, 12, 1, 5, 2, 11, 4, 6, 8, 10, 13]  # scattered blocks
    cache = new_cache(config, dtype)
    steps = [cpu_path.run(model, cache, ids[:N], 0, table)[-1:]]
    for n in range(N + 1, len(ids) + 1):
        steps.append(cpu_path.run(model, cache, ids[:n], n - 1, table))
    incremental = torch.cat(steps)
    full = cpu_path.run(model, new_cache(config, dtype), ids, 0, list(range(15)))[N - 1 :]
    # float32: summation order differs between a 1-row and a many-row GEMM; bfloat16 rows are bit-identical
    tolerance = 1e-5 if dtype == torch.float32 else 0.0
    assert (incremental - full).abs().max().item() <= tolerance


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_give_the_plain_gemm_results(tiny_model_factory, cpu_path, dtype):
    """oneDNN's packed weights compute the same logits, the plain block weights are dropped, and calibration
    pads exactly the GEMMs whose rows would otherwise depend on their batch."""
    from model.linear import Linear, OneDnnLinear

    if not OneDnnLinear.available(
        dtype, torch.device("cpu")
    ):  # oneDNN's bfloat16 needs AVX-512 (or AVX-NE-CONVERT): a CPU without it, or a process run as one
        assert dtype == torch.bfloat16 and "avx512bw" not in cpu_tier.select("auto")[0].needs
        with pytest.raises(RuntimeError, match="bf16 path needs"):
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
        return
    path = tiny_model_factory("qwen2")  # biases on q/k/v, untied LM head
    ids = list(range(10, 50))
    plain, config = cpu_path.load(path, dtype=dtype)
    packed, _ = cpu_path.load(path, dtype=dtype, linear=OneDnnLinear(batch_invariant=True))
    linears = [m for m in packed.layers.modules() if isinstance(m, Linear)]
    assert all(m.weight.is_meta and m.packed is not None for m in linears)
    a = cpu_path.run(plain, new_cache(config, dtype), ids, 0, list(range(16)))
    b = cpu_path.run(packed, new_cache(config, dtype), ids, 0, list(range(16)))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 if dtype == torch.float32 else 0.0)

    g = torch.Generator().manual_seed(1)
    for m in linears:
        x = torch.randn(16, m.in_features, generator=g).to(dtype)
        with torch.inference_mode():
            batch = m(x)
            assert all(torch.equal(m(x[i : i + 1]), batch[i : i + 1]) for i in range(16))


@pytest.mark.timeout(60)
def test_missing_and_mismatched_tensors_are_named(tiny_model_factory, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_model_factory("llama")
    for case in ("missing", "shape"):
        dst = tmp_path / case
        shutil.copytree(src, dst)
        tensors = load_file(dst / "model.safetensors")
        name = "model.layers.1.mlp.down_proj.weight"
        if case == "missing":
            del tensors[name]
        else:
            tensors[name] = tensors[name][:, :-1].contiguous()
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(WeightLoadError, match=name):
            load_model(dst)


@pytest.mark.timeout(60)
def test_sharded_checkpoint_loads(tiny_model_factory, tmp_path, cpu_path):
    import transformers

    src = tiny_model_factory("qwen2")
    ref = transformers.AutoModelForCausalLM.from_pretrained(src)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    assert (tmp_path / "model.safetensors.index.json").exists()
    a, config = cpu_path.load(src)
    b, _ = cpu_path.load(tmp_path)
    ids = list(range(3, 20))
    assert torch.equal(
        cpu_path.run(a, new_cache(config), ids, 0, [0, 1, 2, 3, 4]),
        cpu_path.run(b, new_cache(config), ids, 0, [0, 1, 2, 3, 4]),
    )


@pytest.mark.timeout(30)
def test_unknown_architecture_is_named(tmp_path):
    import json

    from model.config import ModelConfig, UnsupportedModelError

    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["FalconForCausalLM"], "vocab_size": 10})
    )
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.timeout(30)
def test_config_reads_transformers_4_and_5_layouts_alike():
    from model.config import ModelConfig

    base = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": 2,
    }  # fmt: skip
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    v4 = ModelConfig.from_dict(
        {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    v5 = ModelConfig.from_dict(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert v4 == v5
    rope = v4.layers[0].rope
    assert rope.theta == 5e5 and rope.kind == "llama3" and dict(rope.scaling)["factor"] == 8.0
    # stop tokens: the union of config.json and generation_config.json (int or list)
    assert ModelConfig.from_dict(base, {"eos_token_id": [7, 2]}).eos_token_ids == (2, 7)


@pytest.mark.timeout(120)
def test_mistral_sliding_window_matches_transformers(tiny_model_factory, cpu_path):
    path = tiny_model_factory("mistral", sliding_window=8)
    model, config = cpu_path.load(path)
    assert config.kv_group_windows == (8,)
    ids = list(range(3, 43))
    ours = cpu_path.run(model, new_cache(config), ids, 0, list(range(16)))
    assert (ours - reference_logits(path, ids)).abs().max().item() < 1e-4


def test_row_buckets_bound_the_gemm_shapes():
    """Padded row counts never shrink, add at most 25%, and stay few (oneDNN keeps memory per shape)."""
    from model.linear import row_bucket

    assert [row_bucket(n) for n in range(1, 9)] == list(range(1, 9))
    assert all(n <= row_bucket(n) <= 1.25 * n for n in range(1, 5000))
    assert len({row_bucket(n) for n in range(1, 513)}) <= 32
    assert all(row_bucket(row_bucket(n)) == row_bucket(n) for n in range(1, 5000))
