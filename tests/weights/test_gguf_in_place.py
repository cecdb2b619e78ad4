"""A GGUF file served in place (weights/gguf_source.py): the same model as the folder
`kvserve convert-gguf` makes of it, with no file written anywhere."""

import mmap
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from model.kernels import cpu_kernels
from model.kv_cache import KVCache
from model.linear import Linear, PlainLinear
from model.quant import QuantizedLinear
from tests.helpers.gguf_writers import prompt_ids, tiny_hf_model, write_llama_cpp_gguf, write_tiny_gguf
from tests.helpers.tiny_models import CpuPath, cache_blocks
from weights import gguf_source
from weights.gguf_convert import convert_gguf
from weights.gguf_source import GGMLBlocks, GGUFSource

KERNELS = CpuPath(kernels=True)


def files_under(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def logits(model, quantized: bool) -> tuple[torch.Tensor, list]:
    """The float32 logits of a fixed prompt, and the bits of each linear layer (None: dense)."""
    linear = QuantizedLinear(cpu_kernels(), PlainLinear()) if quantized else PlainLinear()
    ours, config = KERNELS.load(model, linear=linear)
    ids = prompt_ids(config.vocab_size)[0].tolist()
    out = KERNELS.run(
        ours, KVCache(config, cache_blocks(config, 64), 4, torch.float32, "cpu"), ids, 0, list(range(16))
    )
    return out, [getattr(m, "bits", None) for m in ours.modules() if isinstance(m, Linear)]


def assert_in_place_is_the_folder(gguf: Path, folder: Path) -> None:
    """Quantized weights kept (where the GGUF has them): in place == the converted folder, bit for bit (kvserve's
    kernels sum in a fixed order). Dequantized: the same weights, but torch's float32 GEMM (MKL) may sum in
    another order for weights at another address (the folder's are mmapped at safetensors' 8-byte offsets, the
    dequantized ones 64-byte aligned), so within float32 rounding."""
    convert_gguf(gguf, folder, progress=False)
    for quantized in (True, False):
        in_place, bits = logits(GGUFSource(gguf), quantized)
        converted, folder_bits = logits(folder, quantized)
        assert bits == folder_bits
        if quantized:
            assert torch.equal(in_place, converted)
        else:
            torch.testing.assert_close(in_place, converted, rtol=0, atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "F16"])
def test_in_place_gives_the_converted_folders_logits(tmp_path, byte_vocab, type_name):
    """A llama (q/k rows permuted as llama.cpp stores them) in each type: in place, its quantized rows are
    unpermuted as raw blocks, and give the bits the folder's do."""
    write_tiny_gguf(tmp_path / "tiny.gguf", byte_vocab, qtype=GGMLQuantizationType[type_name])
    assert_in_place_is_the_folder(tmp_path / "tiny.gguf", tmp_path / "converted")
    if type_name != "F16":
        source = GGUFSource(tmp_path / "tiny.gguf")
        q = source.get("model.layers.0.self_attn.q_proj.weight")
        assert isinstance(q, GGMLBlocks) and q.type_name == type_name and q.blocks.dtype == torch.uint8
        assert isinstance(source.get("model.norm.weight"), torch.Tensor)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "family,fuse_qkv",
    [("llama", True), ("gemma3", False), ("phi3", False)],
    ids=["fused-attn_qkv-split", "gemma-norm-offset", "phi3-qkv-fused"],
)
def test_llama_cpp_conversions_are_undone_in_place(tmp_path, byte_vocab, family, fuse_qkv):
    """Q8_0 files as llama.cpp's converter writes them: a fused attn_qkv split by rows (of raw blocks), Gemma's
    +1 taken off its norms, Phi-3's q/k/v kept fused: in place as in the folder."""
    tiny_hf_model(family, len(byte_vocab["tokens"])).save_pretrained(tmp_path / "hf")
    gguf = tmp_path / "tiny.gguf"
    written = write_llama_cpp_gguf(tmp_path / "hf", gguf, byte_vocab, GGMLQuantizationType.Q8_0, fuse_qkv)
    assert ("blk.0.attn_qkv.weight" in written) is (fuse_qkv or family == "phi3")
    assert_in_place_is_the_folder(gguf, tmp_path / "converted")


@pytest.mark.timeout(60)
def test_serve_reads_the_file_in_place_and_writes_nothing(tmp_path, byte_vocab, monkeypatch):
    """`--model FILE.gguf` as the CLI resolves it: a GGUFSource the engine loads, quantized weights kept; nothing
    appears next to the file or in the weights folder."""
    from server.commands import resolve_model
    from server.engine.config import EngineConfig
    from server.engine.engine import Engine
    from server.engine.request import SamplingParams

    (tmp_path / "models").mkdir()
    gguf = tmp_path / "models" / "tiny.gguf"
    write_tiny_gguf(gguf, byte_vocab, qtype=GGMLQuantizationType.Q4_1)
    (tmp_path / "weights").mkdir()
    monkeypatch.setenv("KVSERVE_WEIGHTS_DIR", str(tmp_path / "weights"))
    before = files_under(tmp_path)
    source = resolve_model(Namespace(model=str(gguf), weights_dir=None))
    assert isinstance(source, GGUFSource)
    engine = Engine(source, EngineConfig(kv_cache_memory=8 << 20, block_size=4))
    assert {m.bits for m in engine.runner.model.modules() if isinstance(m, Linear)} == {4}
    assert engine.tokenizer.has_chat_template  # from the GGUF's metadata
    engine.add_request("r", engine.tokenizer.encode("hello"), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert files_under(tmp_path) == before


@pytest.mark.timeout(30)
def test_the_map_is_let_go_once_read(tmp_path, byte_vocab):
    """Each tensor read is a copy: nothing read keeps the file's pages, and reading it again (the map's pages
    let go) gives the same values."""
    write_tiny_gguf(tmp_path / "tiny.gguf", byte_vocab, qtype=GGMLQuantizationType.Q8_0)
    source = GGUFSource(tmp_path / "tiny.gguf")
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        first, again = source.get(name), source.get(name)
        first, again = (x.blocks if isinstance(x, GGMLBlocks) else x for x in (first, again))
        assert torch.equal(first, again) and first.data_ptr() != again.data_ptr(), name
        assert not np.shares_memory(first.numpy(), source.tensors["token_embd.weight"].data)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("type_name", ["F32", "BF16", "Q4_1"])
def test_the_header_reads_as_ggufs_reader_reads_it(tmp_path, byte_vocab, type_name):
    """read_gguf's metadata (strings, numbers, arrays of both) and tensors are gguf's GGUFReader's."""
    from gguf import GGUFReader

    from weights.gguf_source import read_gguf

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, byte_vocab, qtype=GGMLQuantizationType[type_name])
    meta, tensors, _ = read_gguf(gguf)
    reader = GGUFReader(gguf)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta == expected and [type(v) for v in meta.values()] == [type(v) for v in expected.values()]
    assert list(tensors) == [t.name for t in reader.tensors]
    for theirs in reader.tensors:
        ours = tensors[theirs.name]
        assert (ours.tensor_type, ours.shape, ours.data_offset, ours.n_bytes) == (
            theirs.tensor_type, tuple(theirs.shape), theirs.data_offset, theirs.n_bytes
        )  # fmt: skip
        assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data), theirs.name


# granitemoe: every expert's in one Hugging Face tensor, each expert read as its slice of it
MOE_FAMILIES = ["qwen3moe", "qwen2moe", "olmoe", "granitemoe", "mixtral"]


def write_moe_gguf(tmp_path, vocab, family, type_name, **writer_args) -> Path:
    """A tiny MoE model written as llama.cpp's converter writes it, matrices (experts stacked) in type_name."""
    tiny_hf_model(family, len(vocab["tokens"])).save_pretrained(tmp_path / "hf")
    gguf = tmp_path / f"{family}.gguf"
    write_llama_cpp_gguf(tmp_path / "hf", gguf, vocab, GGMLQuantizationType[type_name], **writer_args)
    return gguf


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_moe_experts_stay_quantized_in_place(tmp_path, byte_vocab, family, type_name):
    """Each expert's gate, up and down come out of the stacked ffn_*_exps as its own block rows: every expert's
    Linear keeps the GGUF's bits, the router stays float32, and the logits are the dequantized model's but for the
    quantized GEMMs' rounding of activations (measured: 5e-6..1e-5 of the largest logit, every argmax equal)."""
    gguf = write_moe_gguf(tmp_path, byte_vocab, family, type_name)
    dense, _ = logits(GGUFSource(gguf), quantized=False)
    ours, config = KERNELS.load(GGUFSource(gguf), linear=QuantizedLinear(cpu_kernels(), PlainLinear()))
    experts = {n: m for n, m in ours.named_modules() if isinstance(m, Linear) and ".experts." in n}
    assert len(experts) == config.num_layers * config.moe.num_experts * 2  # up (gate | up) and down
    assert {m.bits for m in experts.values()} == {8 if type_name == "Q8_0" else 4}
    assert all(layer.mlp.router.weight.dtype == torch.float32 for layer in ours.layers)
    ids = prompt_ids(config.vocab_size)[0].tolist()
    quantized = KERNELS.run(
        ours, KVCache(config, cache_blocks(config, 64), 4, torch.float32, "cpu"), ids, 0, list(range(16))
    )
    assert (quantized - dense).abs().max() < 1e-3 * dense.abs().max()
    assert (quantized.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.9


def expert_matrices(source: GGUFSource) -> list[tuple[str, int | None]]:
    """Each expert's matrices: (a Hugging Face tensor of its own, None), or (one stacking every expert's, which
    expert: Granite MoE's)."""
    own = [(name, None) for name in source.shapes if ".experts." in name]
    stacked = [(name, e) for name, shape in source.shapes.items() if len(shape) == 3 for e in range(shape[0])]
    return own + stacked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_in_place_is_the_folder_and_each_expert_its_own_blocks(tmp_path, byte_vocab, family):
    """Q8_0: an expert's tensor is exactly the blocks quantize gives its Hugging Face matrix (its slice of the
    stacked tensor, no arithmetic; Granite MoE's gate | up made of two), a tensor stacking every expert's
    is theirs stacked, and in place gives the converted folder's logits (bit for bit on the quantized kernels)."""
    gguf = write_moe_gguf(tmp_path, byte_vocab, family, "Q8_0")
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    source = GGUFSource(gguf)
    config = source.config
    experts = config.get("num_experts", config.get("num_local_experts"))
    size = config.get("moe_intermediate_size") or config["intermediate_size"]
    rows = 0
    for name, e in expert_matrices(source):
        got = source.get(name) if e is None else source.get(name, e)
        assert isinstance(got, GGMLBlocks) and got.type_name == "Q8_0", name
        matrix = saved[name] if e is None else saved[name][e]
        assert np.array_equal(got.blocks.numpy(), quantize(matrix.numpy(), GGMLQuantizationType.Q8_0)), name
        assert torch.equal(source.dense(name) if e is None else source.dense(name, e), got_dense(got)), name
        rows += got.shape[0]
        if e == 0:
            whole = source.get(name)
            assert whole.shape == saved[name].shape and torch.equal(whole.blocks[0], got.blocks), name
    # gate, up and down of every expert of both layers, once each
    assert rows == config["num_hidden_layers"] * experts * (2 * size + config["hidden_size"])
    assert_in_place_is_the_folder(gguf, tmp_path / "converted")


def got_dense(blocks: GGMLBlocks) -> torch.Tensor:
    values = dequantize(blocks.blocks.numpy(), GGMLQuantizationType[blocks.type_name])
    return torch.from_numpy(values.reshape(blocks.shape))


@pytest.mark.timeout(120)
def test_fused_gate_up_exps_is_split_per_expert(tmp_path, byte_vocab):
    """llama.cpp's --fuse-gate-up-exps stacks each expert's gate rows, then its up rows: split, they are the
    unfused file's tensors."""
    apart = GGUFSource(write_moe_gguf(tmp_path / "apart", byte_vocab, "qwen3moe", "Q8_0"))
    fused_gguf = write_moe_gguf(tmp_path / "fused", byte_vocab, "qwen3moe", "Q8_0", fuse_gate_up_exps=True)
    fused = GGUFSource(fused_gguf)
    assert "blk.0.ffn_gate_up_exps.weight" in fused.tensors
    assert "blk.0.ffn_up_exps.weight" not in fused.tensors
    assert fused.shapes == apart.shapes
    for name in apart.shapes:
        ours, theirs = fused.get(name), apart.get(name)
        if isinstance(theirs, GGMLBlocks):
            assert ours.shape == theirs.shape and torch.equal(ours.blocks, theirs.blocks), name
        else:
            assert torch.equal(ours, theirs), name
    assert_in_place_is_the_folder(fused_gguf, tmp_path / "converted")


class MadviseLog:
    """Stands in for the source's map where _release madvises: records the ranges let go."""

    def __init__(self):
        self.calls = []

    def madvise(self, *args):
        self.calls.append(args)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("family", "name", "expert", "sources"),
    [
        ("qwen3moe", "model.layers.1.mlp.experts.5.down_proj.weight", None, ["ffn_down_exps"]),
        # expert 5's slice of Granite MoE's every-expert tensor: its gate rows and its up rows
        (
            "granitemoe",
            "model.layers.1.block_sparse_moe.input_linear.weight",
            5,
            ["ffn_gate_exps", "ffn_up_exps"],
        ),
    ],
)
def test_an_expert_is_dequantized_and_let_go_alone(
    tmp_path, byte_vocab, monkeypatch, family, name, expert, sources
):
    """dense() on one expert dequantizes that expert's slice only (a 30B-A3B layer has 128), and both reads let
    go of that expert's bytes only, never the whole stacked tensor."""
    source = GGUFSource(write_moe_gguf(tmp_path, byte_vocab, family, "Q8_0"))
    tensors = [source.tensors[f"blk.1.{short}.weight"] for short in sources]
    # from the page holding the expert's first byte to its last byte, in each GGUF tensor
    ranges = set()
    for tensor in tensors:
        per_expert = tensor.n_bytes // tensor.data.shape[0]
        start = tensor.data_offset + 5 * per_expert
        ranges.add((start // mmap.PAGESIZE * mmap.PAGESIZE, start + per_expert))
    shapes = []
    real = gguf_source.dequantize
    monkeypatch.setattr(
        gguf_source, "dequantize", lambda data, kind: shapes.append(data.shape) or real(data, kind)
    )
    released = source._map = MadviseLog()
    value = source.dense(name, expert)
    assert shapes == [tensor.data.shape[1:] for tensor in tensors]
    expected = np.concatenate([dequantize(t.data[5], GGMLQuantizationType.Q8_0) for t in tensors])
    assert torch.equal(value, torch.from_numpy(expected))
    source.get(name, expert)
    assert {(at, at + length) for _, at, length in released.calls} == ranges
    assert all(advice == mmap.MADV_DONTNEED for advice, _, _ in released.calls)
    assert len(released.calls) == 2 * len(tensors)
