"""Gemma 4's GGUF files as llama.cpp's own converter writes them (convert_hf_to_gguf.py, conversion/gemma.py's
Gemma4Model, run from the tree test_gguf_llama_cpp.py fetches): tiny random Gemma4ForConditionalGeneration
checkpoints with E2B's shape (per-layer inputs, the last layers reading an earlier one's K/V with double-wide MLPs,
full layers of their own heads with keys as values) and 26B-A4B's (experts beside the dense MLP), and a tokenizer of
Gemma 4's kind. Served in place, they give transformers' logits; converted back, the same model; their tokenizer
tokenizes as the checkpoint's."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.gguf_writers import prompt_ids, served_logits, trained_bpe
from tests.helpers.tiny_models import FAMILY_OVERRIDES, tiny_config
from tests.weights.test_gguf_llama_cpp import llama_cpp_tree  # noqa: F401 (a fixture)
from weights.gguf_convert import convert_gguf
from weights.gguf_source import GGUFSource

pytestmark = pytest.mark.slow

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
# written as USER_DEFINED by the converter ("always render these tokens, so that the chat parser can read them")
VISIBLE = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>']
MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
TEXTS = [
    "Hello world, the quick brown fox.",
    "  two  spaces\nnew line\ttab",
    "émoji 🙂 and 日本語",
    "<|turn>user\nhi<turn|>\n<|turn>model\n",
    'call:f{a:<|"|>x<|"|>}',
]


def save_gemma4_tokenizer(out: Path) -> None:
    """A BPE over "▁"-spelled text with byte fallback, as Gemma's tokenizer.json is, with Gemma 4's markers (written
    by scripts/make_gemma4_gguf.py's save_tokenizer, as its real-sized files' are)."""
    from tokenizers import pre_tokenizers

    script = Path(__file__).parents[2] / "scripts" / "make_gemma4_gguf.py"
    spec = importlib.util.spec_from_file_location("make_gemma4_gguf", script)
    make_gemma4_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_gemma4_gguf)
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    pieces, merges = trained_bpe(metaspace, [], vocab_size=300)
    vocab = {token: i for i, token in enumerate(SPECIALS + VISIBLE)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    pairs = [tuple(m.split(" ")) for m in merges]
    pairs = [p for p in pairs if p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab]
    make_gemma4_gguf.save_tokenizer(out, vocab, pairs, SPECIALS, VISIBLE)


def gemma4_checkpoint(out: Path, **overrides):
    """A tiny random Gemma4ForConditionalGeneration (a one-layer vision tower, no audio) saved with the tokenizer:
    its norms, scales and q norms moved from their init as tests/helpers/tiny_models.py moves them."""
    import transformers

    out.mkdir(parents=True)
    save_gemma4_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    dims = dict(vocab_size=len(vocab), vocab_size_per_layer_input=len(vocab))
    text = tiny_config("gemma4", **(FAMILY_OVERRIDES["gemma4"] | dims | overrides))
    text.pad_token_id, text.bos_token_id, text.eos_token_id = 0, 2, 1
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16,
    )  # fmt: skip
    config = transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None
    )
    config.architectures = ["Gemma4ForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("q_norm.weight"):
                p.mul_(p.shape[0] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return model


def convert(tree: Path, hf: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's converter, whole and unchanged, on the checkpoint (its own gguf-py, not the installed one)."""
    env = os.environ | {"PYTHONPATH": str(tree / "gguf-py")}
    command = [sys.executable, tree / "convert_hf_to_gguf.py", hf, "--outtype", outtype, "--outfile", out]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.fixture(scope="module", params=["e2b", "26b-a4b"])
def converted(request, llama_cpp_tree, tmp_path_factory):  # noqa: F811
    """(the checkpoint's model, its folder, llama.cpp's F32 GGUF of it)"""
    tmp = tmp_path_factory.mktemp(request.param)
    model = gemma4_checkpoint(tmp / "hf", **(MOE if request.param == "26b-a4b" else {}))
    return model, tmp / "hf", convert(llama_cpp_tree, tmp / "hf", tmp / "model.gguf")


def test_the_files_config_is_the_checkpoints(converted):
    model, _, gguf = converted
    config = GGUFSource(gguf).config
    text = model.config.text_config.to_dict()
    full = text["per_layer_config"][str(text["layer_types"].index("full_attention"))]
    assert (config["global_head_dim"], config["num_global_key_value_heads"]) == (
        full["head_dim"], full["num_key_value_heads"]
    )  # fmt: skip
    for key in ("layer_types", "head_dim", "num_key_value_heads", "attention_k_eq_v", "num_kv_shared_layers",
                "use_double_wide_mlp", "hidden_size_per_layer_input", "sliding_window", "final_logit_softcapping",
                "intermediate_size", "rope_parameters"):  # fmt: skip
        assert config[key] == text[key], key
    assert bool(config.get("enable_moe_block")) == text["enable_moe_block"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernels", [True, False])
def test_served_in_place_it_gives_the_checkpoints_logits(converted, kernels):
    from model.linear import PlainLinear

    model, _, gguf = converted
    ours, _ = served_logits(GGUFSource(gguf), PlainLinear(), kernels)
    with torch.no_grad():
        reference = model(prompt_ids(model.config.text_config.vocab_size)).logits[0]
    assert (ours - reference).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.timeout(300)
def test_converted_back_it_is_the_checkpoints_model(converted, tmp_path):
    from transformers import AutoModelForCausalLM

    model, _, gguf = converted
    convert_gguf(gguf, tmp_path / "out", progress=False)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = prompt_ids(model.config.text_config.vocab_size)
    with torch.no_grad():
        assert (back(ids).logits - model(ids).logits).abs().max().item() < 1e-5


def test_its_tokenizer_tokenizes_as_the_checkpoints(converted):
    from tokenizers import Tokenizer

    from weights.gguf_source import read_gguf
    from weights.gguf_tokenizer import build_tokenizer

    _, hf, gguf = converted
    ours, config = build_tokenizer(read_gguf(gguf)[0])
    theirs = Tokenizer.from_file(str(hf / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert (config["bos_token"], config["eos_token"]) == ("<bos>", "<eos>")


@pytest.mark.timeout(300)
def test_its_q8_0_file_is_served_quantized(converted, llama_cpp_tree, tmp_path):  # noqa: F811
    """llama.cpp's Q8_0 (every matrix but the router's and the norms'): its blocks kept as they are, on the C++
    kernels, close to the same weights dequantized."""
    from model.kernels import cpu_kernels
    from model.linear import PlainLinear
    from model.quant import QuantizedLinear

    _, hf, _ = converted
    gguf = convert(llama_cpp_tree, hf, tmp_path / "q8_0.gguf", "q8_0")
    dense, _ = served_logits(GGUFSource(gguf), PlainLinear(), True)
    quantized, bits = served_logits(GGUFSource(gguf), QuantizedLinear(cpu_kernels(), PlainLinear(), 8), True)
    assert 8 in bits
    assert ((quantized - dense).abs().mean() / dense.abs().mean()).item() < 0.01
    assert (quantized.argmax(-1) == dense.argmax(-1)).float().mean().item() >= 0.95
