"""scripts/make_moe_gguf.py: a cut of a MoE model grown to more layers, tensor by tensor, with random weights that
kvserve serves (and llama.cpp's llama-quantize requantizes: checked by hand on the 48-layer Qwen3-30B-A3B shape,
README's Benchmarks)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, Keys, LlamaFileType
from gguf.quants import dequantize

from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import SamplingParams
from tests.helpers.gguf_writers import tiny_hf_model, write_llama_cpp_gguf
from weights.gguf_source import GGUFSource

SCRIPT = Path(__file__).parents[2] / "scripts" / "make_moe_gguf.py"


def grow(cut: Path, out: Path, *flags: str) -> GGUFReader:
    subprocess.run([sys.executable, str(SCRIPT), str(cut), str(out), *flags], check=True, capture_output=True)
    return GGUFReader(out)


@pytest.mark.timeout(120)
def test_a_qwen3moe_cut_grows_to_more_layers_that_kvserve_serves(tmp_path, byte_vocab):
    tiny_hf_model("qwen3moe", len(byte_vocab["tokens"])).save_pretrained(tmp_path / "hf")
    cut_path = tmp_path / "cut.gguf"
    write_llama_cpp_gguf(tmp_path / "hf", cut_path, byte_vocab, GGMLQuantizationType.Q8_0)
    cut = GGUFReader(cut_path)
    grown = grow(cut_path, tmp_path / "grown.gguf", "--layers", "5", "--seed", "3")

    fields = {name: f.contents() for name, f in grown.fields.items() if not name.startswith("GGUF.")}
    assert fields["qwen3moe.block_count"] == 5
    assert fields[Keys.General.FILE_TYPE] == LlamaFileType.MOSTLY_Q4_0
    for name, field in cut.fields.items():  # the tokenizer and the shape's keys are the cut's
        if name.startswith(("tokenizer.", "qwen3moe.")) and name != "qwen3moe.block_count":
            assert fields[name] == field.contents(), name

    cut_tensors = {t.name: t for t in cut.tensors}
    assert len(grown.tensors) == len(cut_tensors) + 3 * sum(n.startswith("blk.0.") for n in cut_tensors)
    for t in grown.tensors:
        like = cut_tensors[
            t.name.replace(f"blk.{t.name.split('.')[1]}.", "blk.0.", 1) if "blk." in t.name else t.name
        ]
        assert list(t.shape) == list(like.shape), t.name
        f32 = like.tensor_type == GGMLQuantizationType.F32  # norms and routers stay F32
        assert t.tensor_type == (GGMLQuantizationType.F32 if f32 else GGMLQuantizationType.Q4_0), t.name
        values = dequantize(t.data, t.tensor_type)
        if t.name.endswith("_norm.weight"):
            assert np.all(values == 1), t.name
        else:  # transformers' init: a normal of std 0.02 (Q4_0's rounding adds ~10%)
            assert 0.015 < values.std() < 0.025 and abs(values.mean()) < 0.005, t.name
    experts = [t for t in grown.tensors if t.name.endswith("ffn_up_exps.weight")]
    assert not np.array_equal(experts[0].data, experts[-1].data)  # every tensor drawn on its own

    again = grow(cut_path, tmp_path / "again.gguf", "--layers", "5", "--seed", "3")
    assert all(np.array_equal(a.data, b.data) for a, b in zip(grown.tensors, again.tensors, strict=True))

    source = GGUFSource(tmp_path / "grown.gguf")
    assert source.config["num_hidden_layers"] == 5 and source.quantized
    engine = Engine(source, EngineConfig(kv_cache_memory=8 << 20, block_size=4))
    engine.add_request(
        "r", list(range(3, 20)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    tokens = []
    while engine.has_work():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == 4


def test_a_cut_whose_layers_differ_is_refused(tmp_path):
    """The script repeats layer 0: a cut with a dense layer among sparse ones (Qwen3-MoE's mlp_only_layers) is not
    one shape repeated."""
    writer = GGUFWriter(tmp_path / "cut.gguf", "qwen3moe")
    writer.add_block_count(2)
    for name in ("blk.0.ffn_gate_exps.weight", "blk.1.ffn_gate.weight"):
        writer.add_tensor(name, np.zeros((4, 32), np.float32), raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(tmp_path / "cut.gguf"),
            str(tmp_path / "out.gguf"),
            "--layers",
            "4",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "repeats layer 0" in out.stderr and not (tmp_path / "out.gguf").exists()
