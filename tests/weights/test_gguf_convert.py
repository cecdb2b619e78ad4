"""GGUF conversion on tiny synthetic llamas: tensor types, q/k row order, config, tokenizers, errors."""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tests.helpers.gguf_writers import write_tiny_gguf
from weights.gguf_convert import UnsupportedGGUFError, convert_gguf, faithful_dtype

# Every type gguf.quants can both write and read back (the K-quants it only reads).
QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  def add(a, b):\n\treturn a + b  # 12 + 345\n",
    "Café naïve résumé, 日本語, emoji 🙂🚀",
    "digits 1234567 3.14 and  42",
    " leading space",
    "trailing spaces   ",
    "blank\n\n\nlines\r\n",
]


def convert(tmp_path, vocab, **kwargs):
    weights = write_tiny_gguf(tmp_path / "tiny.gguf", vocab, **kwargs)
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    return weights, tmp_path / "out"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_tensors_equal_dequantized_source(tmp_path, byte_vocab, type_name):
    qtype = GGMLQuantizationType[type_name]
    weights, out = convert(tmp_path, byte_vocab, qtype=qtype)
    converted = load_file(out / "model.safetensors")
    assert converted.keys() == weights.keys()
    for name, original in weights.items():
        # Quantization works on blocks within a row, so it commutes with llama.cpp's reordering of q/k rows:
        # quantizing the Hugging Face rows directly gives what the converter must hand back.
        expected = original if original.ndim == 1 else dequantize(quantize(original, qtype), qtype)
        assert torch.equal(converted[name].float(), torch.from_numpy(expected)), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_quantized_file_keeps_the_gguf_blocks_as_they_are(tmp_path, byte_vocab, type_name):
    """quantized/model.safetensors: every quantized weight as the GGUF's raw block rows (in Hugging Face's row
    order), which the loader reads as the kernels' integers and scales giving back the dequantized values (Q4_0
    up to one rounding: we keep d q - 8 d for d (q - 8)), and dequantizes the types no kernel keeps."""
    from model.gguf_blocks import BLOCKS, gguf_weight
    from model.loader import Checkpoint
    from model.quant import QuantizedTensor

    qtype = GGMLQuantizationType[type_name]
    weights, out = convert(tmp_path, byte_vocab, qtype=qtype)
    dense = load_file(out / "model.safetensors")
    ckpt = Checkpoint(out, quantized=True)
    for name, original in weights.items():
        got = ckpt.get(ckpt.resolve(name))
        if original.ndim == 2 and type_name not in ("F32", "F16", "BF16"):
            type_got, blocks, shape = got
            assert (type_got, shape) == (type_name, original.shape), name
            assert np.array_equal(blocks.numpy(), quantize(original, qtype)), name
            got = gguf_weight(type_got, blocks, shape)
            kept = type_name in BLOCKS
            assert isinstance(got, QuantizedTensor) is kept, name
            if kept:
                assert got.kind == type_name, name
                got = got.dequantize()
        assert isinstance(got, torch.Tensor), name
        tol = 2**-20 * dense[name].abs().max().item() if type_name == "Q4_0" else 0
        torch.testing.assert_close(got.float(), dense[name].float(), rtol=0, atol=tol)


@pytest.mark.timeout(60)
def test_q_k_permutation_round_trip(tmp_path, byte_vocab):
    weights, out = convert(tmp_path, byte_vocab)
    converted = load_file(out / "model.safetensors")
    stored = {t.name: np.array(t.data) for t in GGUFReader(tmp_path / "tiny.gguf").tensors}
    for layer in range(2):
        for hf, gguf in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
            original = weights[f"model.layers.{layer}.self_attn.{hf}.weight"]
            assert not np.array_equal(
                stored[f"blk.{layer}.{gguf}.weight"], original
            )  # the file holds permuted rows
            assert torch.equal(
                converted[f"model.layers.{layer}.self_attn.{hf}.weight"], torch.from_numpy(original)
            )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tied", [False, True])
def test_config_files(tmp_path, byte_vocab, tied):
    _, out = convert(tmp_path, byte_vocab, tied=tied)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 128, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["rms_norm_eps"], config["rope_theta"], config["max_position_embeddings"]) == (
        1e-5,
        10000.0,
        256,
    )
    assert config["vocab_size"] == len(byte_vocab["tokens"])
    assert config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) is not tied
    assert config["torch_dtype"] == "float32"  # random float32 weights are exact only in float32
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": 1}
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|begin_of_text|>"
    assert tokenizer_config["eos_token"] == "<|end_of_text|>"
    assert tokenizer_config["add_bos_token"] is True
    assert tokenizer_config["chat_template"] == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tokenizer_config["model_max_length"] == 256


@pytest.mark.timeout(10)
def test_faithful_dtype_is_narrowest_exact():
    assert faithful_dtype([torch.tensor([0.5, -2.0, 1024.0])]) == torch.float16
    assert faithful_dtype([torch.tensor([2.0**-20, 2.0**100])]) == torch.bfloat16  # out of float16's range
    assert faithful_dtype([torch.tensor([0.1])]) == torch.float32


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("vocab_name", "pre"),
    [("byte_vocab", "llama-bpe"), ("byte_vocab", "qwen2"), ("byte_vocab", "gpt2"), ("spm_vocab", None)],
)
def test_tokenizer_matches_transformers_gguf_loader(tmp_path, request, vocab_name, pre):
    from transformers import AutoTokenizer

    vocab = request.getfixturevalue(vocab_name)
    vocab = dict(vocab, pre=pre) if pre else vocab
    _, out = convert(tmp_path, vocab)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    from_folder = AutoTokenizer.from_pretrained(out)  # transformers reading what we wrote
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids[0] == vocab["bos"]  # every vocabulary here adds BOS
        assert ours.decode(ids) == text
        assert from_folder(text)["input_ids"] == ids
        if vocab_name == "spm_vocab" and text[0].isspace():
            continue  # transformers drops SentencePiece's dummy prefix here: see test_sentencepiece_spaces
        assert ids == reference(text)["input_ids"], text


@pytest.mark.timeout(120)
def test_added_tokens_stay_whole(tmp_path, byte_vocab):
    from transformers import AutoTokenizer

    _, out = convert(tmp_path, byte_vocab)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    text = "<|begin_of_text|>hi<|end_of_text|> there, call <tool> now"
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    tool = byte_vocab["tokens"].index("<tool>")
    assert ids[0] == 0 and 1 in ids and tool in ids
    # Control tokens are special (skipped when decoding); the user-defined <tool> is text.
    assert ours.decode(ids) == "hi there, call <tool> now"
    assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.timeout(60)
def test_sentencepiece_spaces(tmp_path, spm_vocab):
    """llama.cpp (like SentencePiece's dummy prefix) puts a space before the text and before the text after each
    special token, even when the text starts with a space."""
    _, out = convert(tmp_path, spm_vocab)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))

    def pieces(text: str) -> list[int]:
        return ours.encode(text, add_special_tokens=False).ids

    assert ours.normalizer.normalize_str(" x  y") == "▁▁x▁▁y"
    assert pieces("<s>hi</s> there") == [1, *pieces("hi"), 2, *pieces(" there")]
    assert ours.encode(" there").ids == [1, *pieces(" there")]
    assert ours.decode(ours.encode(" there").ids) == " there"


@pytest.mark.timeout(60)
def test_unknown_pre_tokenizer_is_named(tmp_path, byte_vocab):
    with pytest.raises(UnsupportedGGUFError, match="made-up-pre"):
        convert(tmp_path, dict(byte_vocab, pre="made-up-pre"))


@pytest.mark.timeout(60)
def test_unknown_tokenizer_model_is_named(tmp_path, byte_vocab):
    with pytest.raises(UnsupportedGGUFError, match="'bert'"):
        convert(tmp_path, dict(byte_vocab, model="bert"))


@pytest.mark.timeout(60)
def test_other_architecture_is_named(tmp_path, byte_vocab):
    with pytest.raises(UnsupportedGGUFError, match="'gemma2'"):
        convert(tmp_path, byte_vocab, arch="gemma2")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"token_embd.weight": np.zeros((401, 64), np.int32)}, "type I32"),
        ({"blk.0.attn_q.bias": np.zeros(64, np.float32)}, "blk.0.attn_q.bias"),
        ({"rope_freqs.weight": np.ones(8, np.float32)}, "rope_freqs"),
    ],
)
def test_unsupported_tensors_are_named(tmp_path, byte_vocab, raw, message):
    with pytest.raises(UnsupportedGGUFError, match=message):
        convert(tmp_path, byte_vocab, raw=raw)
