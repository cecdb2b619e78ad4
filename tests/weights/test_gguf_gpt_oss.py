"""GPT-OSS from GGUF: llama.cpp's own converter writes a tiny random GPT-OSS (`gpt-oss`: sinks, a window on every
other layer, YaRN, q/k/v/o, router and expert biases, the clamped SwiGLU), and kvserve serves the file in place
with transformers' logits on the folder it came from; the same file with its experts in MXFP4 (as llama-quantize's
MXFP4_MOE writes them) keeps them quantized on the kernels and gives the logits of that model with those values."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from model.kernels import cpu_kernels
from model.linear import PlainLinear
from model.quant import QuantizedLinear
from tests.helpers.gguf_writers import TinyFamily, prompt_ids, reference_logits, served_logits, tiny_hf_model
from tests.weights.test_gguf_llama_cpp import DRIVER, llama_cpp_tree  # noqa: F401 (a fixture)
from weights.gguf_source import GGUFSource

pytestmark = pytest.mark.slow

GPT_OSS = TinyFamily("gpt-oss", "GptOssConfig", "GptOssForCausalLM", dict(
    hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=8, swiglu_limit=7.0,
    tie_word_embeddings=False, max_position_embeddings=256,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 16, "rope_theta": 1e4},
))  # fmt: skip
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(scope="module")
def gpt_oss_gguf(llama_cpp_tree, tmp_path_factory, byte_vocab):  # noqa: F811
    """(the transformers model, llama.cpp's F32 GGUF of it)"""
    tmp = tmp_path_factory.mktemp("gpt_oss")
    model = tiny_hf_model(GPT_OSS, len(byte_vocab["tokens"]))
    model.save_pretrained(tmp / "hf")
    tokenizer = {"model": {"vocab": {t: i for i, t in enumerate(byte_vocab["tokens"])}}, "added_tokens": []}
    (tmp / "hf" / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp / "vocab.json").write_text(json.dumps(byte_vocab))
    run = subprocess.run(
        [sys.executable, DRIVER, llama_cpp_tree, tmp / "hf", tmp / "gpt-oss.gguf", tmp / "vocab.json", "f32"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return model, tmp / "gpt-oss.gguf"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernels", [True, False])
def test_llama_cpp_gguf_serves_as_transformers_runs_the_folder(gpt_oss_gguf, kernels):
    model, gguf = gpt_oss_gguf
    source = GGUFSource(gguf)
    assert source.config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert source.config["rope_scaling"]["truncate"] is False
    ours, _ = served_logits(source, PlainLinear(), kernels)
    want = reference_logits(model)
    assert (ours - want).abs().max() < 1e-4, (ours - want).abs().max()


def requantized(gguf, path, type_name: str = "MXFP4"):
    """The GGUF again, its experts' weights in `type_name`; and those weights as the file now holds them."""
    reader = GGUFReader(gguf)
    writer = GGUFWriter(path, "gpt-oss")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        value = field.contents()
        if kind.name == "ARRAY":
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, kind)
    stored = {}
    qtype = GGMLQuantizationType[type_name]
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if any(tensor.name.endswith(f"{kind}.weight") for kind in EXPERTS):
            blocks = quantize(data, qtype)
            stored[tensor.name] = dequantize(blocks, qtype)
            writer.add_tensor(tensor.name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def with_experts(model, stored: dict) -> None:
    """The transformers model's experts set to the GGUF's values (gate and up interleaved, as its layout is)."""
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate, up, down = (torch.from_numpy(stored[f"blk.{i}.{kind}.weight"]) for kind in EXPERTS)
            experts = layer.mlp.experts
            experts.gate_up_proj[:, :, 0::2] = gate.transpose(1, 2)
            experts.gate_up_proj[:, :, 1::2] = up.transpose(1, 2)
            experts.down_proj.copy_(down.transpose(1, 2))


@pytest.mark.timeout(300)
def test_mxfp4_experts_stay_quantized_and_exact(gpt_oss_gguf, tmp_path):
    model, gguf = gpt_oss_gguf
    stored = requantized(gguf, tmp_path / "mxfp4.gguf")
    source = GGUFSource(tmp_path / "mxfp4.gguf")
    assert {source.tensors[f"blk.0.{kind}.weight"].tensor_type.name for kind in EXPERTS} == {"MXFP4"}
    with_experts(model, stored)
    want = reference_logits(model)
    kernels = QuantizedLinear(cpu_kernels(), PlainLinear())
    ours, bits = served_logits(source, kernels, True)
    # every expert's up and down kept as 4-bit levels (4 layers, 8 experts); attention and the head F32, dense
    assert bits.count(4) == 4 * 8 * 2 and bits.count(None) == len(bits) - 4 * 8 * 2
    # the exact weights; the kernels take float32 activations as int16 on AVX2 tiers, whose rounding (half a
    # step of 1/32767 of each group's largest input) is the only error beside float32 sums
    assert (ours - want).abs().max() < 2e-3, (ours - want).abs().max()
    dense, _ = served_logits(source, PlainLinear(), True)  # the experts dequantized at load: the same weights
    assert (dense - want).abs().max() < 1e-4


@pytest.mark.timeout(300)
def test_mxfp4_experts_on_the_gpus_path_are_grouped_and_exact(gpt_oss_gguf, tmp_path, triton_here):
    """The same file as a GPU serves it (under Triton's interpreter): every expert's MXFP4 levels kept on the
    device, each sparse layer's experts grouped (their biases and clamped SwiGLU beside the quantized GEMMs), and
    transformers' logits with those values."""
    from model.kv_cache import KVCache
    from model.linear_triton import TritonQuantLinear
    from tests.helpers.tiny_models import CpuPath, cache_blocks
    from tests.model.test_moe_triton import sparse_layers

    model, gguf = gpt_oss_gguf
    stored = requantized(gguf, tmp_path / "mxfp4.gguf")
    with_experts(model, stored)
    want = reference_logits(model)
    path = CpuPath(kernels=False, gpu_attention="triton")
    linear = TritonQuantLinear(torch.device("cpu"), torch.float32, PlainLinear())
    ours, config = path.load(GGUFSource(tmp_path / "mxfp4.gguf"), linear=linear)
    layers = sparse_layers(ours)
    assert len(layers) == 4 and all(layer.grouped is not None for layer in layers)
    assert all(run.quantized.kind == "MXFP4" for layer in layers for run in layer.grouped.up.runs)
    cache = KVCache(config, cache_blocks(config, 64), 4, torch.float32, "cpu")
    got = path.run(ours, cache, prompt_ids(config.vocab_size)[0].tolist(), 0, list(range(16)))
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()


@pytest.mark.timeout(120)
def test_convert_gguf_refuses_gpt_oss_by_name(gpt_oss_gguf, tmp_path):
    from weights.gguf_convert import UnsupportedGGUFError, convert_gguf

    with pytest.raises(UnsupportedGGUFError, match="serve the file in place"):
        convert_gguf(gpt_oss_gguf[1], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
