"""A GGUF's tokenizer as a Hugging Face `tokenizers` Tokenizer plus its tokenizer_config.json, tokenizing the way
llama.cpp does: byte-level BPE (`tokenizer.ggml.model` gpt2: Llama 3, Qwen2/2.5/3, SmolLM/SmolLM3, Phi-4, OLMo 2,
Granite 3, Mistral Nemo/Ministral), SentencePiece BPE (llama: Llama 2, Mistral 7B, Phi-3, Gemma 2/3) or Gemma 4's BPE
over "▁"-spelled text (gemma4)."""

from typing import Any, NamedTuple

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

# The regexes llama.cpp splits byte-level text with (src/llama-vocab.cpp, llm_tokenizer_bpe), as it runs them:
# contractions match ASCII case only ('[sS], where the models' own (?i:'s) also takes "'ſ"), and the Tekken and
# GPT-4o letter classes are its approximation of [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]* [\p{Ll}\p{Lm}\p{Lo}\p{M}]+: an
# upper run is letters other than a-z, a lower run letters other than A-Z, and combining marks are no letters.
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (
    CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
UPPER, LOWER = r"(?:(?=\p{L})[^a-z])", r"(?:(?=\p{L})[^A-Z])"
TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+{CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*{CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class BytePre(NamedTuple):
    """What llama.cpp does for one tokenizer.ggml.pre: the regexes it splits with, one after the other, whether a
    piece that is a whole token is taken as is (ignore_merges), and whether BOS is added when the file does not say."""

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


BYTE_PRES = {
    "gpt2": BytePre((GPT2_SPLIT,)),  # GPT-2's own (llama.cpp names it "gpt-2")
    "llama-bpe": BytePre((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),  # Llama 3.x
    "smaug-bpe": BytePre((LLAMA3_SPLIT,)),  # SmolLM3 (a Llama 3 vocabulary)
    "dbrx": BytePre((LLAMA3_SPLIT,)),  # cl100k vocabularies: Phi-4, OLMo 2
    "qwen2": BytePre((QWEN2_SPLIT,)),  # Qwen2, Qwen2.5, Qwen3
    "smollm": BytePre((r"\p{N}", GPT2_SPLIT)),  # SmolLM, SmolLM2: every digit alone, then GPT-2's
    "refact": BytePre((r"\p{N}", GPT2_SPLIT)),  # Granite 3
    "gpt-4o": BytePre((GPT4O_SPLIT,)),  # o200k: Phi-4-mini
    "tekken": BytePre((TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),  # Mistral Nemo, Ministral
}


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
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in BYTE_PRES:
            raise UnsupportedGGUFError(
                f"pre-tokenizer {pre!r} is not supported (supported: {list(BYTE_PRES)})"
            )
        tokenizer = byte_level_bpe(tokens, required(meta, "tokenizer.ggml.merges"), BYTE_PRES[pre])
        bos_by_default = BYTE_PRES[pre].add_bos
    elif kind == "gemma4":
        tokenizer = gemma4_bpe(
            tokens, required(meta, "tokenizer.ggml.merges"), meta.get("tokenizer.ggml.unknown_token_id")
        )
        bos_by_default = True
    elif kind == "llama":
        scores = required(meta, "tokenizer.ggml.scores")
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        tokenizer = sentencepiece_bpe(tokens, scores, types, unk_id, add_prefix)
        bos_by_default = True
    else:
        raise UnsupportedGGUFError(
            f"tokenizer model {kind!r} is not supported (only 'gpt2', 'llama' and 'gemma4')"
        )

    # Control tokens (<|im_start|>, <start_of_turn>) are special; user-defined ones (<think>, Gemma's "\n\n" and
    # runs of spaces) are matched whole too but stay in decoded text, as llama.cpp and transformers treat them. Both
    # are matched in the raw text before anything else and keep the GGUF's id: their text is in the vocab.
    special = [t for t, kind in zip(tokens, types, strict=True) if kind in (CONTROL, UNKNOWN) and t]
    user_defined = [t for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED and t]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in user_defined])

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None else None

    bos, eos = token("bos"), token("eos")
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


def byte_level_bpe(tokens: list[str], merges: list[str], pre: BytePre) -> Tokenizer:
    """GPT-2 style BPE: tokens are spelled in the byte-to-unicode alphabet, merges are "left right" strings."""
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ")) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_bpe(
    tokens: list[str], scores: list[float], types: list[int], unk_id: int | None, add_prefix: bool
) -> Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: "▁" for spaces, byte fallback to <0xNN> tokens.

    Gemma's files store its whitespace-run tokens (2 to 31 spaces, 1 to 31 newlines) as user-defined tokens
    spelled with real spaces, so, as in llama.cpp, they are matched in the raw text longest first and never take
    part in merges. transformers' GGUF loader respells them "▁▁..." and merges them instead; it then differs from
    llama.cpp (and from SentencePiece's own longest match) on runs of more than 31 spaces, which it cuts elsewhere,
    and on text holding "▁" itself, which it joins with the following spaces. kvserve follows llama.cpp."""
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    merges = sentencepiece_merges(tokens, scores, types)
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # llama.cpp puts a space before the text and before each stretch of text after a special token (SentencePiece's
    # dummy prefix). A normalizer runs once per stretch between added tokens, so Prepend does exactly that.
    # (transformers' GGUF loader uses Metaspace instead, which adds no "▁" where the text starts with a space.)
    # Gemma's files turn the prefix off (tokenizer.ggml.add_space_prefix = false).
    prefix = [normalizers.Prepend("▁")] if add_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def gemma4_bpe(tokens: list[str], merges: list[str], unk_id: int | None) -> Tokenizer:
    """Gemma 4's BPE (llama.cpp's gemma4 tokenizer model): its merges run on the text itself, spaces spelled "▁",
    with no space put before the text, and a byte missing from the pieces falls back to its <0xNN> token."""
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ")) for merge in merges]
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece merges the adjacent pair whose joined piece scores highest. A GGUF keeps pieces and scores but
    no merge list, so rebuild one: every split of a piece into two pieces, best joined score first (ties: longer
    left part, then longer right part, then vocabulary order, which is the order transformers uses).

    Gemma's 262,144 pieces give 1.1 M splits to look up and 0.5 M merges: about 2.5 s of the whole build's 3-4 s,
    in one comprehension and one sort of tuples whose index makes every key unique (the strings are never compared).
    The merges only join NORMAL pieces. llama.cpp would also join into any other token, but control and
    user-defined ones are matched whole before merging, and a byte token only if the text spells "<0xNN>" itself."""
    ids = {
        token: index for index, (token, kind) in enumerate(zip(tokens, types, strict=True)) if kind == NORMAL
    }
    # (-score, -len(left), -len(right), index, piece): ascending is best first
    found = [
        (-scores[index], -cut, cut - len(piece), index, piece)
        for piece, index in ids.items()
        for cut in range(1, len(piece))
        if piece[:cut] in ids and piece[cut:] in ids
    ]
    found.sort()
    return [(piece[:-minus_cut], piece[-minus_cut:]) for _, minus_cut, _, _, piece in found]
