"""Convert a llama-family GGUF file into the Hugging Face folder layout kvserve loads.

The folder gets model.safetensors (dequantized, Hugging Face tensor names and row order), config.json,
generation_config.json, tokenizer.json and tokenizer_config.json. Anything the converter cannot reproduce
faithfully raises UnsupportedGGUFError naming it, rather than writing a subtly wrong model.
"""

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tqdm import tqdm


class UnsupportedGGUFError(ValueError):
    """The GGUF uses an architecture, tensor type, tensor or tokenizer this converter does not handle."""


# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

# tokenizer.ggml.pre -> the regex its byte-level vocabulary was trained with (the same ones llama.cpp uses).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
SPLIT_PATTERNS = {"llama-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}

# GGUF tensor name (inside blk.N) -> Hugging Face name (inside model.layers.N).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def convert_gguf(src: Path, dst: Path, progress: bool = True) -> None:
    reader = GGUFReader(src)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedGGUFError(f"{src}: architecture {arch!r} is not supported (only 'llama')")
    gguf_tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = model_config(meta, gguf_tensors)
    # The tokenizer is cheap to build, so an unsupported one fails before the slow part.
    tokenizer, tokenizer_config = build_tokenizer(meta)
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]

    tensors = convert_tensors(gguf_tensors, config, progress)
    dtype = faithful_dtype(list(tensors.values()))
    config["torch_dtype"] = str(dtype).removeprefix("torch.")

    dst.mkdir(parents=True, exist_ok=True)
    save_file({name: t.to(dtype) for name, t in tensors.items()}, dst / "model.safetensors", {"format": "pt"})
    # safetensors creates the file owner-only (0600); a server running as another user must still read it.
    (dst / "model.safetensors").chmod(0o644)
    tokenizer.save(str(dst / "tokenizer.json"))
    write_json(dst / "tokenizer_config.json", tokenizer_config)
    write_json(dst / "config.json", config)
    special_ids = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    write_json(dst / "generation_config.json", special_ids)


def model_config(meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    hidden = required(meta, "llama.embedding_length")
    num_heads = required(meta, "llama.attention.head_count")
    head_dim = meta.get("llama.attention.key_length", hidden // num_heads)
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedGGUFError(
            f"partial rotary embedding ({meta['llama.rope.dimension_count']} of {head_dim})"
        )
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensors:
        raise UnsupportedGGUFError(f"rope scaling ({scaling!r}, or llama3 rope_freqs) is not supported")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": required(meta, "llama.feed_forward_length"),
        "num_hidden_layers": required(meta, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shortest_float(required(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": shortest_float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": required(meta, "llama.context_length"),
        # GGUF shapes list the row length first: token_embd is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
    }
    for name, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if (token_id := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[name] = token_id
    return config


def required(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedGGUFError(f"GGUF metadata has no {key!r}")
    return meta[key]


def shortest_float(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.999999747e-06. Write the shortest decimal of the same float32."""
    return float(str(np.float32(value)))


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (q_rows, hidden),
            prefix + "self_attn.k_proj.weight": (kv_rows, hidden),
            prefix + "self_attn.v_proj.weight": (kv_rows, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q_rows),
            prefix + "mlp.gate_proj.weight": (ffn, hidden),
            prefix + "mlp.up_proj.weight": (ffn, hidden),
            prefix + "mlp.down_proj.weight": (hidden, ffn),
        }
    return shapes


def convert_tensors(
    gguf_tensors: dict[str, ReaderTensor], config: dict[str, Any], progress: bool
) -> dict[str, torch.Tensor]:
    shapes = expected_shapes(config)
    tensors = {}
    for tensor in tqdm(
        gguf_tensors.values(), desc="Converting GGUF tensors", unit="tensor", disable=not progress
    ):
        name = hf_name(tensor.name)
        values = dequantize_tensor(tensor)
        if name not in shapes or values.shape != shapes[name]:
            raise UnsupportedGGUFError(
                f"tensor {tensor.name} ({name}): shape {values.shape}, expected {shapes.get(name)}"
            )
        if name.endswith("q_proj.weight"):
            values = unpermute_rows(values, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            values = unpermute_rows(values, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(values)
    if missing := sorted(shapes.keys() - tensors.keys()):
        raise UnsupportedGGUFError(f"GGUF lacks tensors for {missing[:5]} ({len(missing)} missing)")
    return tensors


def hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    parts = base.split(".")
    if kind == "weight" and base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.weight"
    if kind == "weight" and len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.weight"
    raise UnsupportedGGUFError(
        f"tensor {gguf_name!r} has no Llama counterpart (biases and experts are not supported)"
    )


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise UnsupportedGGUFError(
            f"tensor {tensor.name}: type {tensor.tensor_type.name} cannot be dequantized"
        ) from None
    # GGUF lists dimensions fastest-varying first (ne[0] is the row length); numpy lists them the other way round.
    shape = tuple(int(n) for n in reversed(tensor.shape))
    # F32 tensors come back as a read-only view of the memory-mapped file; torch wants writable memory.
    return np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]).reshape(shape)


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order, giving back Hugging Face's.

    Hugging Face's rotary code pairs row r of a head with row r + head_dim/2 (rotate_half); llama.cpp pairs adjacent
    rows, so its converter stores, per head, rows 0, d/2, 1, d/2+1, ... Viewing each head as (d/2, 2) and swapping
    the two axes restores 0, 1, ..., d/2-1, d/2, ...
    """
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(weight.shape)


def faithful_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The narrowest dtype that holds every dequantized value bit for bit; float32 always does."""
    for dtype in (torch.float16, torch.bfloat16):
        if all(torch.equal(t.to(dtype).float(), t) for t in tensors):
            return dtype
    return torch.float32


def build_tokenizer(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = required(meta, "tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2":
        tokenizer = byte_level_bpe(tokens, required(meta, "tokenizer.ggml.merges"), pre)
    elif kind == "llama":
        scores = required(meta, "tokenizer.ggml.scores")
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        tokenizer = sentencepiece_bpe(tokens, scores, types, unk_id, add_prefix)
    else:
        raise UnsupportedGGUFError(f"tokenizer model {kind!r} is not supported (only 'gpt2' and 'llama')")

    # Control tokens (<|im_start|>, <s>) are special; user-defined ones (<think>) are matched whole too but stay in
    # decoded text, as llama.cpp and transformers treat them. Both keep the GGUF's id: their text is in the vocab.
    special = [t for t, kind in zip(tokens, types, strict=True) if kind in (CONTROL, UNKNOWN) and t]
    user_defined = [t for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED and t]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in user_defined])

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None else None

    bos, eos = token("bos"), token("eos")
    # llama.cpp adds BOS by default for SentencePiece and Llama 3 vocabularies when the file does not say.
    bos_by_default = kind == "llama" or pre == "llama-bpe"
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", bos_by_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    tokenizer.post_processor = template_processing(meta, add_bos, add_eos, bos, eos)

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
    }
    return tokenizer, {key: value for key, value in tokenizer_config.items() if value is not None}


def template_processing(
    meta: dict[str, Any], add_bos: bool, add_eos: bool, bos: str | None, eos: str | None
) -> processors.TemplateProcessing:
    """Adds BOS / EOS around each sequence, the way transformers' fast tokenizers do."""
    single, pair, specials = ["$A:0"], ["$B:1"], []
    if add_bos:
        single, pair = [f"{bos}:0", *single], [f"{bos}:1", *pair]
        specials.append((bos, meta["tokenizer.ggml.bos_token_id"]))
    if add_eos:
        single, pair = [*single, f"{eos}:0"], [*pair, f"{eos}:1"]
        specials.append((eos, meta["tokenizer.ggml.eos_token_id"]))
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(single + pair), special_tokens=specials
    )


def byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    """GPT-2 style BPE: tokens are spelled in the byte-to-unicode alphabet, merges are "left right" strings."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "gpt2":  # GPT-2's regex is built into ByteLevel
        pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre == "smollm":
        # SmolLM's own tokenizer.json (and llama.cpp): every digit alone, then GPT-2's regex.
        digits = pre_tokenizers.Digits(individual_digits=True)
        pre_tokenizer = pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif pre in SPLIT_PATTERNS:
        split = pre_tokenizers.Split(Regex(SPLIT_PATTERNS[pre]), behavior="isolated")
        pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        supported = ["gpt2", "smollm", *SPLIT_PATTERNS]
        raise UnsupportedGGUFError(f"pre-tokenizer {pre!r} is not supported (supported: {supported})")
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ")) for merge in merges]
    # Llama 3 takes a piece that is a whole token as is, even where no merge chain builds it.
    tokenizer = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre == "llama-bpe"))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_bpe(
    tokens: list[str], scores: list[float], types: list[int], unk_id: int | None, add_prefix: bool
) -> Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: "▁" for spaces, byte fallback to <0xNN> tokens."""
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    merges = sentencepiece_merges(tokens, scores, types)
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # llama.cpp puts a space before the text and before each stretch of text after a special token (SentencePiece's
    # dummy prefix). A normalizer runs once per stretch between added tokens, so Prepend does exactly that.
    # (transformers' GGUF loader uses Metaspace instead, which adds no "▁" where the text starts with a space.)
    prefix = [normalizers.Prepend("▁")] if add_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece merges the adjacent pair whose joined piece scores highest. A GGUF keeps pieces and scores but
    no merge list, so rebuild one: every split of a piece into two pieces, best joined score first (ties: longer
    left part, then longer right part, then vocabulary order, which is the order transformers uses)."""
    ids = {
        token: index for index, (token, kind) in enumerate(zip(tokens, types, strict=True)) if kind == NORMAL
    }
    candidates = []
    for piece, index in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                candidates.append((-scores[index], -len(left), -len(right), index, left, right))
    return [(left, right) for *_, left, right in sorted(candidates)]


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
