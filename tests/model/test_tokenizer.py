import json
import string
from datetime import datetime

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from model.tokenizer import LONG_TEXT, MAX_HELD_IDS, IncrementalDetokenizer, Tokenizer

SAMPLES = [
    "Hello, world!",
    "Crème brûlée, naïve façade, Ångström, ĳ, ǅ",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Emoji: 😀 👍🏽 🇫🇷 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏿‍🚀",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # comment\n",
    "3.14159 2,718 1234567890 0x1F 1e-9",
    "  leading spaces, trailing tabs\t\t\n\n\n  multiple   runs    of     spaces ",
    "Ελληνικά, русский, עברית, العربية, हिन्दी",
]

CHATS = {
    "system_user_assistant": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? 日本"},
    ],
    "no_system": [{"role": "user", "content": "Hi there 👋"}],
}


@pytest.fixture(scope="module")
def smol(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def hf_smol(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def stream(tokenizer: Tokenizer, ids: list[int], step: int = 1, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    text = "".join(deltas)
    assert detok.text == text
    assert [detok.tail(n) for n in (0, 1, 5, 10_000)] == ["", text[-1:], text[-5:], text]
    return deltas


# --- the default model (byte-level BPE) ---


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_default_model_special_tokens(smol, hf_smol):
    assert (smol.bos_token_id, smol.eos_token_id, smol.eos_token_ids) == (1, 2, {2})
    assert smol.vocab_size == 49152
    assert smol.id_to_token(2) == "<|im_end|>"
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = smol.encode(text)
    assert ids == hf_smol.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert smol.decode(ids) == "user\nHi"
    assert smol.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_long_text_encodes_to_the_same_ids_off_the_gil(smol):
    """Past LONG_TEXT characters the text goes through tokenizers' batch (which releases the GIL): the same ids,
    special tokens written in it included."""
    text = "<|im_start|>user\n" + "Héllo, wörld! 12 + 30 = 42. " * (LONG_TEXT // 20) + "<|im_end|>"
    assert len(text) >= LONG_TEXT
    ids = smol.encode(text)
    assert ids == smol._tokenizer.encode(text, add_special_tokens=False).ids and ids[0] == 1 and ids[-1] == 2
    assert (
        smol.encode(text, add_special_tokens=True)
        == smol._tokenizer.encode(text, add_special_tokens=True).ids
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", SAMPLES)
def test_default_model_roundtrip(smol, text):
    assert smol.decode(smol.encode(text)) == text


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", CHATS)
def test_chat_template_matches_transformers(smol, hf_smol, name):
    messages = CHATS[name]
    expected = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smol.apply_chat_template(messages) == expected
    expected = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert smol.apply_chat_template(messages, add_generation_prompt=False) == expected


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_chat_template_list_content(smol, hf_smol):
    parts = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]
    # transformers hands the list itself to the template, and ChatML's `'...' + message['content']` fails on it.
    with pytest.raises(TypeError):
        hf_smol.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    # We join the text parts with newlines (as vLLM does) before rendering.
    joined = [{"role": "user", "content": "First part.\nSecond part."}]
    expected = hf_smol.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    assert smol.apply_chat_template([{"role": "user", "content": parts}]) == expected
    with pytest.raises(ValueError, match="image_url"):
        smol.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


CUSTOM_TEMPLATES = {
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}",
    "loopcontrols_namespace": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m.content }}\n{% if ns.n == 2 %}{% break %}{% endif %}{% endfor %}"
    ),
    "variables": (
        "{{ bos_token }}{% if tools is not none %}TOOLS{% endif %}{% if documents is defined %}DOCS{% endif %}"
        "{% for m in messages %}{{ m.content }}{{ eos_token }}{{ m.tool_calls is defined }}{% endfor %}"
        "{{ pad_token }}{{ unk_token }}{% if add_generation_prompt %}GO{% endif %}"
    ),
    "generation_tag": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    ),
    "trim_lstrip_blocks": (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\nU: {{ m.content }}\n    {% else %}\n"
        "{{ m.role }}: {{ m.content }}\n    {% endif %}\n{% endfor %}\n"
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", CUSTOM_TEMPLATES)
def test_custom_templates_match_transformers(default_model_dir, hf_smol, name):
    template = CUSTOM_TEMPLATES[name]
    messages = [
        {"role": "system", "content": "<b>&'quotes'</b> é"},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello", "tool_calls": None},
        {"role": "user", "content": "Bye"},
    ]
    ours = Tokenizer.from_dir(default_model_dir, chat_template=template)
    expected = hf_smol.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages) == expected


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("step", [1, 3])
def test_default_model_stream_is_utf8_safe_and_exact(smol, step):
    for text in SAMPLES:
        ids = smol.encode(text)
        deltas = stream(smol, ids, step)
        assert not any("\ufffd" in d for d in deltas), deltas
        assert "".join(deltas) == smol.decode(ids) == text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_default_model_stream_after_prompt_and_specials(smol):
    prompt = smol.encode(smol.apply_chat_template([{"role": "user", "content": "Say hi"}]))
    output = smol.encode("Hi! 👋 Café<|im_end|>\n<|endoftext|>Más 日本")
    for skip in (True, False):
        deltas = stream(smol, output, prompt_ids=prompt, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == smol.decode(output, skip_special_tokens=skip)


def record_window_sizes(monkeypatch, tokenizer: Tokenizer) -> list[int]:
    sizes = []
    decode = tokenizer.decode

    def recording_decode(ids, skip_special_tokens=True):
        sizes.append(len(ids))
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", recording_decode)
    return sizes


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stream_decodes_a_bounded_window(smol, monkeypatch):
    ids = smol.encode(" ".join(SAMPLES) * 20)
    ids += [smol.eos_token_id] * 500 + smol.encode(" done")  # a run of skipped tokens must not widen it
    assert len(ids) > 3000
    expected = smol.decode(ids)
    sizes = record_window_sizes(monkeypatch, smol)
    assert "".join(stream(smol, ids)) == expected
    assert max(sizes) <= 8


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stream_releases_invalid_utf8_after_a_bounded_hold(smol, monkeypatch):
    continuation_byte = smol._tokenizer.token_to_id("Ģ")  # byte 0x80 in the byte-level alphabet
    ids = smol.encode("ok") + [continuation_byte] * 100 + smol.encode(" fine")
    assert smol.decode(ids) == "ok" + "\ufffd" * 100 + " fine"
    sizes = record_window_sizes(monkeypatch, smol)
    assert "".join(stream(smol, ids)) == "ok" + "\ufffd" * 100 + " fine"
    assert max(sizes) <= 2 * MAX_HELD_IDS  # held ids plus the released ones kept as context


# --- SentencePiece-style tokenizers: "▁" for spaces, byte fallback for everything outside the vocabulary ---


def save_sentencepiece_tokenizer(out, style: str, config: dict) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for ch in "▁" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("l", "l"), ("e", "ll"), ("h", "ell"), ("hell", "o")]
    merges += [("▁", "hello"), ("▁", "w"), ("o", "r"), ("▁w", "or"), ("▁wor", "l"), ("▁worl", "d")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if style == "llama2":  # Llama 2 / Mistral: spaces replaced in the normalizer, one leading space stripped
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:  # newer conversions: a Metaspace pre-tokenizer and decoder
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    out.mkdir(exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def added_token(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False}


@pytest.fixture(params=["llama2", "metaspace"])
def sp(request, tmp_path) -> Tokenizer:
    config = {"bos_token": added_token("<s>"), "eos_token": added_token("</s>"), "add_bos_token": True}
    save_sentencepiece_tokenizer(tmp_path / "sp", request.param, config)
    return Tokenizer.from_dir(tmp_path / "sp")


@pytest.mark.timeout(30)
def test_sentencepiece_special_tokens_from_added_token_dicts(sp):
    assert (sp.bos_token_id, sp.eos_token_id, sp.eos_token_ids) == (1, 2, {2})
    assert sp.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert sp.id_to_token(sp.vocab_size - 1) is not None and sp.id_to_token(sp.vocab_size) is None
    ids = sp.encode("hello world")
    assert ids[0] != 1
    assert sp.encode("hello world", add_special_tokens=True) == [1, *ids]
    assert sp.encode("hello</s>") == [*sp.encode("hello"), 2]


SP_SAMPLES = ["hello the world", "héllo €x ok", "日本 👍🏽 the end", "a  b\tc", "Crème 👨‍👩‍👧 zoo"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("step", [1, 2])
def test_sentencepiece_stream_is_utf8_safe_and_exact(sp, step):
    assert [sp.id_to_token(i) for i in sp.encode("é")] == ["▁", "<0xC3>", "<0xA9>"]  # byte fallback
    for text in SP_SAMPLES:
        ids = sp.encode(text)
        assert sp.decode(ids) == text
        deltas = stream(sp, ids, step)
        assert not any("\ufffd" in d for d in deltas), deltas
        assert "".join(deltas) == text


@pytest.mark.timeout(30)
def test_sentencepiece_stream_with_leading_spaces(sp):
    # A lone "▁" first decodes to nothing: only the next token shows whether it was the stripped prefix space.
    for text in [" hello", "  hello", "   the  world", "\u3000 x"]:
        ids = sp.encode(text)
        assert "".join(stream(sp, ids)) == sp.decode(ids)


@pytest.mark.timeout(30)
def test_sentencepiece_stream_with_skipped_specials(sp):
    ids = [2, *sp.encode("hello"), 1, 2, *sp.encode("the wörld"), 2, 2]
    for skip in (True, False):
        assert "".join(stream(sp, ids, skip_special_tokens=skip)) == sp.decode(ids, skip_special_tokens=skip)


@pytest.mark.timeout(30)
def test_sentencepiece_stream_continues_the_prompt(sp):
    prompt, full = sp.encode("hello"), sp.encode("hello the world")
    output = full[len(prompt) :]
    assert sp.decode(output) == "the world"  # alone, the leading "▁" is dropped
    assert "".join(stream(sp, output, prompt_ids=prompt)) == " the world"


@pytest.mark.timeout(30)
def test_flush_releases_an_incomplete_character(sp):
    euro = sp.encode("€")[1:]  # after "▁": <0xE2> <0x82> <0xAC>
    detok = IncrementalDetokenizer(sp)
    assert detok.add(sp.encode("ok")) == "ok"
    assert detok.add(euro[:1]) == detok.add(euro[1:2]) == ""
    assert detok.flush().startswith("\ufffd")
    assert detok.text == sp.decode([*sp.encode("ok"), *euro[:2]])
    assert detok.flush() == ""


# --- where the chat template comes from ---


@pytest.mark.timeout(30)
def test_chat_template_sources(tmp_path):
    folder = tmp_path / "tok"
    config = {
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "CONFIG"},
        ],
    }
    save_sentencepiece_tokenizer(folder, "metaspace", config)
    user = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_dir(folder).apply_chat_template(user) == "CONFIG"

    (folder / "chat_template.jinja").write_text("JINJA {{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(folder).apply_chat_template(user) == "JINJA hi"

    assert (
        Tokenizer.from_dir(folder, chat_template="ARG {{ eos_token }}").apply_chat_template(user)
        == "ARG </s>"
    )
    template_file = tmp_path / "my_template.jinja"
    template_file.write_text("FILE {{ add_generation_prompt }}")
    tok = Tokenizer.from_dir(folder, chat_template=str(template_file))
    assert tok.apply_chat_template(user, add_generation_prompt=False) == "FILE False"
    with pytest.raises(ValueError, match="not found"):
        Tokenizer.from_dir(folder, chat_template=str(tmp_path / "missing.jinja"))


@pytest.mark.timeout(30)
def test_chat_template_errors(tmp_path):
    save_sentencepiece_tokenizer(tmp_path / "tok", "llama2", {"bos_token": "<s>"})
    tok = Tokenizer.from_dir(tmp_path / "tok")
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="--chat-template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])

    with pytest.raises(ValueError, match="syntax error"):
        Tokenizer.from_dir(tmp_path / "tok", chat_template="{% for m in messages %}")
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('must start with user') }}{% endif %}ok"
    tok = Tokenizer.from_dir(tmp_path / "tok", chat_template=template)
    assert tok.has_chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(ValueError, match="must start with user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="unsafe"):  # the sandbox refuses Python internals
        Tokenizer.from_dir(
            tmp_path / "tok", chat_template="{{ messages.__class__.__mro__ }}"
        ).apply_chat_template([])

    tok = Tokenizer.from_dir(tmp_path / "tok", chat_template="{{ strftime_now('%Y') }}")
    assert tok.apply_chat_template([]) == str(datetime.now().year)


# Templates cut down to how they treat a system message after the first turns.
ALTERNATING = (  # Gemma's way: after an optional leading system message, roles must alternate
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}{% endfor %}"
)
FIRST_SYSTEM_ONLY = (  # messages[0] is the system prompt, and any other system message is left out
    "{% if messages[0].role == 'system' %}[{{ messages[0].content }}]{% endif %}"
    "{% for m in messages %}{% if m.role != 'system' %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
)


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_which_templates_render_a_system_message_where_it_stands(smol, tmp_path):
    assert smol.template_renders_inline_system  # ChatML: a <|im_start|>system turn wherever it stands
    save_sentencepiece_tokenizer(tmp_path / "tok", "llama2", {"bos_token": "<s>"})
    for template in (ALTERNATING, FIRST_SYSTEM_ONLY):
        tok = Tokenizer.from_dir(tmp_path / "tok", chat_template=template)
        assert tok.has_chat_template and not tok.template_renders_inline_system
    assert not Tokenizer.from_dir(tmp_path / "tok").template_renders_inline_system  # no template at all
