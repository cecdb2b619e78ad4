"""A GGUF's tokenizer as a Hugging Face `tokenizers` Tokenizer plus its tokenizer_config.json, the way llama.cpp
and transformers read it: byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM) or SentencePiece BPE (Llama 2)."""

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

# tokenizer.ggml.pre -> the regex its byte-level vocabulary was trained with (the same ones llama.cpp uses).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
SPLIT_PATTERNS = {"llama-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}


class UnsupportedGGUFError(ValueError):
    """The GGUF uses an architecture, tensor type, tensor or tokenizer this converter does not handle."""


def required(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedGGUFError(f"GGUF metadata has no {key!r}")
    return meta[key]


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
