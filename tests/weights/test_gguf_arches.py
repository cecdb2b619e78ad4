"""Every architecture the GGUF converter supports, round-tripped: a tiny random transformers model, written to GGUF
as llama.cpp's converter writes it (tests/helpers/gguf_writers.py), converted back by kvserve, then loaded by
transformers to the same config, the same tensors and the same logits."""

import json
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from model.kernels import cpu_kernels
from model.kv_cache import KVCache
from model.linear import PlainLinear
from tests.helpers.gguf_writers import (
    TINY_FAMILIES,
    add_vocab,
    checkpoint_tensors,
    llama3_rope_freqs,
    prompt_ids,
    tiny_hf_model,
    write_llama_cpp_gguf,
    write_tiny_gguf,
)
from tests.helpers.tiny_models import cache_blocks
from weights.gguf_arch import FAMILIES, MIXTRAL, llama3_scaling, partial_rotary_factor
from weights.gguf_convert import UnsupportedGGUFError, convert_gguf

# config fields a GGUF does not carry (training-only, or transformers' bookkeeping)
UNCARRIED = {
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "initializer_range",
    "use_cache", "attention_dropout", "resid_pdrop", "embd_pdrop", "output_attentions", "output_hidden_states",
    "return_dict", "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "is_encoder_decoder",
    "max_window_layers", "_sliding_window_pattern", "use_bidirectional_attention", "pretraining_tp",
}  # fmt: skip


def round_trip(tmp_path, family, vocab, qtype=GGMLQuantizationType.F32, **writer_args):
    """(the original model, the GGUF tensors written from it, the converted folder)."""
    model = tiny_hf_model(family, len(vocab["tokens"]))
    model.save_pretrained(tmp_path / "hf")
    written = write_llama_cpp_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", vocab, qtype, **writer_args)
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    return model, written, tmp_path / "out"


def gemma_norm(name: str, family: str) -> bool:
    return family.startswith("gemma") and "norm" in name


def assert_same_model(model, out, family, prompt_ids):
    from transformers import AutoConfig, AutoModelForCausalLM

    ours = AutoConfig.from_pretrained(out).to_dict()
    theirs = model.config.to_dict()
    if theirs["model_type"] == "mistral":  # comes back as the Llama it is without a sliding window
        theirs = {k: v for k, v in theirs.items() if k in ours and k != "model_type"}
    differ = {
        k: (theirs.get(k), ours.get(k)) for k in theirs.keys() - UNCARRIED if theirs.get(k) != ours.get(k)
    }
    assert not differ, differ

    state = checkpoint_tensors(model)
    converted = load_file(out / "model.safetensors")
    assert converted.keys() == {
        k for k in state if k != "lm_head.weight" or not model.config.tie_word_embeddings
    }
    for name, tensor in converted.items():
        if gemma_norm(name, family):
            # the GGUF holds fl(1 + w), given back as fl(fl(1 + w) - 1): two float32 roundings, each within
            # 2**-24 of a value no larger than 1 + |w|. Where 1 + w lies in [0.5, 2] the second is exact, and
            # transformers' 1 + w gives back the very fl(1 + w) it computed from the original.
            atol = 2**-23 * (1 + state[name].abs()).max()
            torch.testing.assert_close(tensor, state[name], rtol=0, atol=atol)
            inside = (1 + state[name] >= 0.5) & (1 + state[name] <= 2)
            assert torch.equal((1 + tensor)[inside], (1 + state[name])[inside]), name
        else:
            assert torch.equal(tensor, state[name]), name

    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = prompt_ids(model.config.vocab_size)
    with torch.no_grad():
        expected, got = model(ids).logits, reference(ids).logits
    assert (got - expected).abs().max() < 1e-5


# the architectures `kvserve convert-gguf` refuses (served in place only), each tested from a GGUF llama.cpp's own
# converter writes, in its own module (or its dense sibling's: Qwen3.5-MoE's and Qwen3-Next's in Qwen3.5's)
IN_PLACE_ONLY = {arch for arch, family in FAMILIES.items() if not family.convertible}
# tested by a module of their own on llama.cpp's own converter's files, not by a tiny family here (Gemma 4's
# converter takes only its multimodal checkpoints)
OWN_MODULE = {"gemma4"}
CONVERTIBLE = sorted(set(FAMILIES) - IN_PLACE_ONLY - OWN_MODULE)
TEST_MODULE = {"qwen35moe": "qwen35", "qwen3next": "qwen35"}


def test_every_gguf_architecture_has_a_tiny_family():
    """weights/gguf_arch.py's table read by the tests: a GGUF architecture added there without a tiny model
    here (or, served in place only or in OWN_MODULE, without its own test module) would go untested."""
    from pathlib import Path

    assert {family.arch for family in TINY_FAMILIES.values()} == set(CONVERTIBLE)
    # each by its own name, as parametrized
    assert all(TINY_FAMILIES[arch].arch == arch for arch in CONVERTIBLE)
    here = Path(__file__).parent
    modules = {TEST_MODULE.get(arch, arch).replace("-", "_") for arch in IN_PLACE_ONLY | OWN_MODULE}
    assert all((here / f"test_gguf_{module}.py").exists() for module in modules)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_family_round_trips_to_the_same_model(tmp_path, byte_vocab, family):
    model, _, out = round_trip(tmp_path, family, byte_vocab)
    config = json.loads((out / "config.json").read_text())
    # Mixtral is `llama` with experts
    expected = MIXTRAL if family == "mixtral" else FAMILIES[TINY_FAMILIES[family].arch]
    assert config["architectures"] == [expected.architecture]
    assert_same_model(model, out, family, prompt_ids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_fused_qkv_is_split_or_kept_as_the_family_needs(tmp_path, byte_vocab, family):
    """llama.cpp's --fuse-qkv stacks q, k, v (and their biases) into attn_qkv; Phi-3 keeps them fused in
    Hugging Face too."""
    model, written, out = round_trip(tmp_path, family, byte_vocab, fuse_qkv=True)
    assert "blk.0.attn_qkv.weight" in written and "blk.0.attn_q.weight" not in written
    assert ("blk.0.attn_qkv.bias" in written) is (family == "qwen2")
    assert_same_model(model, out, family, prompt_ids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
def test_quantized_family_gives_the_dequantized_weights(tmp_path, byte_vocab, family):
    """Q8_0: every matrix equals dequantize(quantize(its Hugging Face rows)) (blocks lie within a row, so quantizing
    commutes with llama.cpp's row order), kept as integers in the quantized file; norms stay exact."""
    model, _, out = round_trip(tmp_path, family, byte_vocab, GGMLQuantizationType.Q8_0)
    converted = load_file(out / "model.safetensors")
    kept = load_file(out / "quantized" / "model.safetensors")
    for name, original in model.state_dict().items():
        if name not in converted:
            continue  # the tied head
        original = original.numpy()
        if original.ndim == 2:
            expected = torch.from_numpy(
                dequantize(quantize(original, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
            )
            assert torch.equal(converted[name], expected), name
            # the file's own blocks, in Hugging Face's row order
            assert np.array_equal(kept[name].numpy(), quantize(original, GGMLQuantizationType.Q8_0)), name
        elif not gemma_norm(name, family):
            assert torch.equal(converted[name], torch.from_numpy(original)), name


@pytest.mark.timeout(60)
def test_k_quants_are_kept_as_their_blocks(tmp_path, byte_vocab, cpu_path, caplog):
    """Q4_K and Q6_K (blocks built by hand, as gguf cannot quantize to them) are kept as raw blocks in the
    quantized file, which model/gguf_blocks.py reads back to the values the dense file holds; loaded from it or
    from the GGUF in place, they stay quantized and nothing is dequantized at load."""
    from model.gguf_blocks import from_gguf_blocks
    from model.loader import Checkpoint
    from model.quant import QuantizedLinear
    from weights.gguf_source import GGUFSource

    write_wide_llama(GGUFWriter(tmp_path / "wide.gguf", "llama"), byte_vocab, np.random.default_rng(0))
    convert_gguf(tmp_path / "wide.gguf", tmp_path / "wide", progress=False)
    dense = load_file(tmp_path / "wide" / "model.safetensors")
    ckpt = Checkpoint(tmp_path / "wide", quantized=True)
    for name, kind in (("gate_proj", "Q4_K"), ("up_proj", "Q4_K"), ("down_proj", "Q6_K")):
        name = f"model.layers.0.mlp.{name}.weight"
        type_name, blocks, shape = ckpt.get(name)
        assert type_name == kind and dense[name].abs().max() > 0, name
        assert torch.equal(from_gguf_blocks(type_name, blocks, shape).dequantize(), dense[name]), name
    for model in (tmp_path / "wide", GGUFSource(tmp_path / "wide.gguf")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="model.loader"):
            ours, _ = cpu_path.load(model, linear=QuantizedLinear(cpu_kernels(), PlainLinear()))
        assert "dequantized at load" not in caplog.text
        mlp = ours.layers[0].mlp
        assert mlp.up.kinds == ["Q4_K"] and mlp.down.kinds == ["Q6_K"]


def write_wide_llama(writer: GGUFWriter, vocab: dict, rng: np.random.Generator) -> None:
    """A one-layer llama 256 wide, its MLP in hand-built Q4_K (gate, up) and Q6_K (down) blocks."""
    hidden, ffn, heads = 256, 256, 4
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", hidden),
                       ("feed_forward_length", ffn), ("attention.head_count", heads)]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    add_vocab(writer, vocab)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def blocks(size: int, scales_at: int, num_scales: int) -> np.ndarray:
        """Random bytes, but finite float16 scales (random ones may be inf or NaN)."""
        data = rng.integers(0, 256, (ffn, hidden // 256 * size), dtype=np.uint8)
        data[:, scales_at : scales_at + 2 * num_scales] = np.full(num_scales, 0.01, np.float16).view(np.uint8)
        return data

    writer.add_tensor("token_embd.weight", normal(len(vocab["tokens"]), hidden))
    writer.add_tensor("output_norm.weight", 1 + normal(hidden))
    for name in ("attn_norm", "ffn_norm"):
        writer.add_tensor(f"blk.0.{name}.weight", 1 + normal(hidden))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(f"blk.0.{name}.weight", normal(hidden, hidden))
    for name in ("ffn_gate", "ffn_up"):  # Q4_K blocks begin with d and dmin
        writer.add_tensor(f"blk.0.{name}.weight", blocks(144, 0, 2), raw_dtype=GGMLQuantizationType.Q4_K)
    # Q6_K blocks end with d
    writer.add_tensor("blk.0.ffn_down.weight", blocks(210, 208, 1), raw_dtype=GGMLQuantizationType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


LLAMA3_CASES = [  # (factor, low, high, orig, base, head_dim, whether two or more frequencies are blended)
    (8.0, 1.0, 4.0, 8192, 500000.0, 128, True),  # Llama 3.1 8B
    (32.0, 1.0, 4.0, 8192, 500000.0, 64, True),  # Llama 3.2 1B
    (16.0, 2.0, 6.0, 4096, 10000.0, 128, True),  # off the defaults: fitted
    (8.0, 1.0, 8.0, 2048, 10000.0, 16, True),  # tiny heads: two blended frequencies
    (8.0, 1.0, 4.0, 1024, 10000.0, 16, False),  # one blended frequency
    (4.0, 1.0, 1.5, 300, 10000.0, 16, False),  # none blended
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("factor", "low", "high", "orig", "base", "dim", "fixed"), LLAMA3_CASES)
@pytest.mark.parametrize("orig_in_file", [False, True])
def test_rope_freqs_recover_a_llama3_scaling(factor, low, high, orig, base, dim, fixed, orig_in_file):
    """Whatever parameters come back, transformers' own llama3 frequencies from them equal llama.cpp's
    inv_freq / rope_freqs to float32 rounding; where the divisors fix the blend, they are the original ones, given
    the original context (from the file, or low_freq_factor 1)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    divisors = llama3_rope_freqs(base, dim, factor, low, high, orig)
    scaling = llama3_scaling(divisors, base, dim, orig if orig_in_file else None)
    assert scaling["factor"] == factor
    if fixed and (orig_in_file or low == 1.0):
        got = (
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
            scaling["original_max_position_embeddings"],
        )
        assert got == (low, high, orig)
    config = LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim, max_position_embeddings=131072,
                         rope_parameters={**scaling, "rope_theta": base})  # fmt: skip
    hf, _ = _compute_llama3_parameters(config, "cpu")
    llama_cpp = (
        1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)) / torch.from_numpy(divisors)
    )
    assert ((hf - llama_cpp).abs() / llama_cpp).max() <= 2**-20


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("divisors", "message"),
    [
        (np.ones(8, np.float32), "divides no frequency"),
        (np.array([1, 1, 2, 1, 3, 8, 8, 8], np.float32), "matches no llama3 rope scaling"),  # not monotonic
        (
            np.array([1, 1, 1, 1, 1.5, 2.5, 8, 8], np.float32),
            "matches no llama3 rope scaling",
        ),  # not that blend
    ],
)
def test_rope_freqs_off_every_llama3_curve_are_refused(tmp_path, byte_vocab, divisors, message):
    with pytest.raises(UnsupportedGGUFError, match=f"rope_freqs.weight {message}"):
        write_tiny_gguf(tmp_path / "tiny.gguf", byte_vocab, raw={"rope_freqs.weight": divisors})
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)


@pytest.mark.timeout(60)
def test_unknown_architecture_is_refused_listing_the_supported(tmp_path, byte_vocab):
    write_tiny_gguf(tmp_path / "tiny.gguf", byte_vocab, arch="mamba")
    supported = ", ".join(sorted(FAMILIES))
    with pytest.raises(UnsupportedGGUFError, match=f"'mamba' is not supported \\(supported: {supported}\\)"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"granitemoe.expert_shared_feed_forward_length": 64},
            "granitemoe with a shared expert \\(GraniteMoeShared, expert_shared_feed_forward_length 64\\)",
        ),
        ({"granitemoe.expert_count": 0}, "granitemoe without experts \\(expert_count 0\\)"),
    ],
)
def test_granite_moe_kvserve_cannot_run_is_refused_by_name(tmp_path, byte_vocab, keys, message):
    """GraniteMoeShared, which llama.cpp writes as granitemoe with a shared expert, and a granitemoe without
    experts: refused in place and converted, naming what they are."""
    from weights.gguf_source import GGUFSource

    tiny_hf_model("granitemoe", len(byte_vocab["tokens"])).save_pretrained(tmp_path / "hf")
    write_llama_cpp_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", byte_vocab)
    rewrite_with_keys(tmp_path / "tiny.gguf", tmp_path / "patched.gguf", keys)
    for read in (GGUFSource, lambda path: convert_gguf(path, tmp_path / "out", progress=False)):
        with pytest.raises(UnsupportedGGUFError, match=f"'granitemoe'\\): {message} is not supported"):
            read(tmp_path / "patched.gguf")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"llama.rope.scaling.type": "longrope"}, "rope scaling 'longrope'"),  # longrope without its tensors
        ({"llama.rope.dimension_count": 8}, "partial rotary embedding \\(8 of 16\\)"),
        ({"llama.attention.value_length": 8}, "value heads of another size than the keys \\(16\\)"),
    ],
)
def test_metadata_the_converter_cannot_reproduce_is_refused(tmp_path, byte_vocab, keys, message):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, byte_vocab)
    patched = tmp_path / "patched.gguf"
    rewrite_with_keys(path, patched, keys)
    with pytest.raises(UnsupportedGGUFError, match=message):
        convert_gguf(patched, tmp_path / "out", progress=False)


@pytest.mark.timeout(60)
def test_yarn_is_served_as_transformers_runs_it(tmp_path, byte_vocab, cpu_path):
    """llama.cpp's YaRN keys (as its converter writes them for Qwen3's or QwQ's long context) on a llama: the
    converted folder spells YaRN as transformers does, and the file served in place gives transformers' logits on
    that folder (YaRN's frequencies and attention factor change them at every position)."""
    from transformers import AutoModelForCausalLM

    from weights.gguf_source import GGUFSource

    write_tiny_gguf(tmp_path / "tiny.gguf", byte_vocab)
    keys = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 64}  # fmt: skip
    rewrite_with_keys(tmp_path / "tiny.gguf", tmp_path / "yarn.gguf", keys)
    convert_gguf(tmp_path / "yarn.gguf", tmp_path / "out", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    scaling = reference.config.rope_parameters
    assert (scaling["rope_type"], scaling["factor"]) == ("yarn", 4.0)
    assert scaling["original_max_position_embeddings"] == 64  # of the file's 256
    assert (scaling["beta_fast"], scaling["beta_slow"]) == (32.0, 1.0)  # llama.cpp's defaults
    ids = prompt_ids(reference.config.vocab_size)
    with torch.no_grad():
        want = reference(ids).logits[0]

    def served(path):
        ours, config = cpu_path.load(GGUFSource(path))
        cache = KVCache(config, cache_blocks(config, 64), 4, torch.float32, "cpu")
        return cpu_path.run(ours, cache, ids[0].tolist(), 0, list(range(16)))

    assert (served(tmp_path / "yarn.gguf") - want).abs().max() < 1e-4
    assert (served(tmp_path / "tiny.gguf") - want).abs().max() > 1e-2  # the keys changed the model


def rewrite_with_keys(src, dst, keys: dict) -> None:
    """Copy a GGUF, setting (or adding) metadata keys."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in keys:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    for name, value in keys.items():
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_partial_rotary_factor_gives_back_the_rotary_width():
    for head_dim in range(2, 257, 2):
        for rope_dims in range(2, head_dim + 1, 2):
            assert int(head_dim * partial_rotary_factor(rope_dims, head_dim)) == rope_dims


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", [*CONVERTIBLE, "mixtral"])  # a tiny family per GGUF architecture
@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_kvserve_serves_every_family_from_gguf(tmp_path, byte_vocab, cpu_path, family, type_name):
    """kvserve's model on the converted folder against the original transformers model: float32 logits on a
    prompt longer than every window (F32), and with the GGUF's Q8_0 integers kept on kvserve's quantized GEMMs
    (their rounding of the activations apart) the same top token nearly everywhere."""
    from model.kernels import cpu_kernels
    from model.linear import PlainLinear
    from model.quant import QuantizedLinear

    model, _, out = round_trip(tmp_path, family, byte_vocab, GGMLQuantizationType[type_name])
    linear = QuantizedLinear(cpu_kernels(), PlainLinear(), None) if type_name == "Q8_0" else PlainLinear()
    ours, config = cpu_path.load(out, linear=linear)
    ids = prompt_ids(model.config.vocab_size)
    got = cpu_path.run(
        ours,
        KVCache(config, cache_blocks(config, 64), 4, torch.float32, "cpu"),
        ids[0].tolist(),
        0,
        list(range(16)),
    )
    with torch.no_grad():
        expected = model(ids).logits[0]
    if type_name == "F32":
        assert (got - expected).abs().max() < 1e-4
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    else:
        assert any(getattr(m, "bits", None) == 8 for m in ours.modules())  # the GGUF's own integers
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.85
