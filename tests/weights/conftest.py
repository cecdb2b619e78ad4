"""Tiny llama GGUFs written with gguf.GGUFWriter, in any tensor type gguf can quantize, with a trained vocabulary."""

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))\n",
    "Prices rose 3.5% in 2024, from 1,200 to 1,242 units.",
    "Café, naïve, résumé: accents are letters too.",
    "Hello world! Hello there, world. Say hello to the world again and again.",
    "tokenizers split text into pieces, then merge the pieces that were seen most often.",
]

# Hugging Face tensor name -> GGUF name inside blk.N (the map llama.cpp's converter uses).
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's HF-to-GGUF converter does to q and k: per head, rows (0, d/2), (1, d/2+1), ... side by side."""
    rows = weight.shape[0]
    split = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def tiny_weights(vocab_size: int, tied: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of a 2-layer llama in Hugging Face names, layout and row order."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": normal(vocab_size, HIDDEN),
        "model.norm.weight": 1 + normal(HIDDEN),
    }
    if not tied:
        weights["lm_head.weight"] = normal(vocab_size, HIDDEN)
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "input_layernorm.weight": 1 + normal(HIDDEN),
            prefix + "post_attention_layernorm.weight": 1 + normal(HIDDEN),
            prefix + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            prefix + "mlp.gate_proj.weight": normal(FFN, HIDDEN),
            prefix + "mlp.up_proj.weight": normal(FFN, HIDDEN),
            prefix + "mlp.down_proj.weight": normal(HIDDEN, FFN),
        }
    return weights


def gguf_name(hf_name: str) -> str:
    name = hf_name.removesuffix(".weight")
    if name.startswith("model.layers."):
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        return f"blk.{layer}.{LAYER_NAMES[rest]}.weight"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[
        name
    ] + ".weight"


def trained_bpe(
    pre_tokenizer, special_tokens: list[str], vocab_size: int = 400, **trainer_args
) -> tuple[list, list]:
    """(tokens in id order, merges as "left right") of a BPE trained on CORPUS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False, **trainer_args
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def byte_level_vocab(pre: str = "llama-bpe") -> dict:
    """GGUF tokenizer metadata of a byte-level BPE, as llama.cpp writes it: control tokens first, a user-defined
    token last, added tokens spelled as plain text."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokens, merges = trained_bpe(byte_level, specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokens.append("<tool>")
    types = [TokenType.CONTROL] * 2 + [TokenType.NORMAL] * (len(tokens) - 3) + [TokenType.USER_DEFINED]
    return dict(model="gpt2", pre=pre, tokens=tokens, types=types, merges=merges, bos=0, eos=1, add_bos=True)


def sentencepiece_vocab() -> dict:
    """GGUF tokenizer metadata of a SentencePiece BPE: <unk>, <s>, </s>, 256 byte tokens, then scored pieces."""
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    pieces, _ = trained_bpe(metaspace, [], vocab_size=300)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + pieces
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * len(pieces)
    # Pieces the trainer made later merge later: SentencePiece scores them lower.
    scores = [0.0] * 259 + [-float(index) for index in range(len(pieces))]
    return dict(model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2, unk=0)


def write_tiny_gguf(
    path: Path,
    vocab: dict,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    tied: bool = False,
    arch: str = "llama",
    raw: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF (q/k permuted as llama.cpp does, 2-D tensors in qtype, norms F32); returns the
    Hugging Face weights it holds. `raw` adds or replaces tensors, by GGUF name, written as they are."""
    weights = tiny_weights(len(vocab["tokens"]), tied)
    raw = raw or {}
    writer = GGUFWriter(path, arch)
    for key, value in [
        ("block_count", LAYERS),
        ("context_length", 256),
        ("embedding_length", HIDDEN),
        ("feed_forward_length", FFN),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV_HEADS),
        ("rope.dimension_count", HEAD_DIM),
        ("vocab_size", len(vocab["tokens"])),
    ]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)

    writer.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    if "unk" in vocab:
        writer.add_unk_token_id(vocab["unk"])
    if "add_bos" in vocab:
        writer.add_add_bos_token(vocab["add_bos"])
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    for name, value in raw.items():
        writer.add_tensor(name, value)
    for name, value in weights.items():
        if gguf_name(name) in raw:
            continue
        if name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, HEADS)
        elif name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, KV_HEADS)
        if value.ndim == 1:
            writer.add_tensor(gguf_name(name), value)
        else:
            data = quantize(value, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture(scope="session")
def tiny_gguf():
    """write_tiny_gguf, for tests (a fixture, because conftest modules are not imported by name)."""
    return write_tiny_gguf


@pytest.fixture(scope="session")
def byte_vocab() -> dict:
    return byte_level_vocab("llama-bpe")


@pytest.fixture(scope="session")
def spm_vocab() -> dict:
    return sentencepiece_vocab()


@pytest.fixture(scope="session")
def default_gguf(default_model_dir: Path) -> Path:
    """The GGUF that ensure_default_model keeps next to the converted default model."""
    return default_model_dir.parent / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
