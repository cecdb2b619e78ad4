"""Tokenizer: the `tokenizers` library plus a Jinja chat template, and UTF-8 safe streaming detokenization."""

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Self

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

# Named special tokens that transformers hands to every chat template as strings (bos_token, eos_token, ...).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Prompt ids kept as context for the first output token, so it decodes as a continuation of the prompt.
PROMPT_CONTEXT_IDS = 4
# Real text ends inside a character for at most 3 ids in a row (measured on SmolLM2's tokenizer over emoji ZWJ
# sequences, CJK, Tibetan and random code points). Longer runs are invalid UTF-8 from the model: released as
# decoded, U+FFFD included, to keep the window bounded.
MAX_HELD_IDS = 16


# A text this long (characters) is encoded as a batch of one: `tokenizers` holds the GIL through a lone encode,
# and a 4 MB prompt held it ~2.5 s, stalling every other thread of the server (its event loop's streams too)
LONG_TEXT = 1 << 16


class Tokenizer:
    """A Hugging Face `tokenizer.json` with the special tokens and chat template of its folder."""

    def __init__(
        self, tokenizer: HFTokenizer, special_tokens: dict[str, str], chat_template: str | None = None
    ):
        self._tokenizer = tokenizer
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.chat_template = chat_template
        # Compiled up front so that a broken --chat-template fails at startup, not on the first request.
        self._template = _compile_template(chat_template) if chat_template is not None else None
        # Templates that render tools read `tools`; for the others the caller writes tools into the messages.
        self.template_renders_tools = chat_template is not None and "tools" in _template_variables(
            chat_template
        )
        # Whether a system message after the first turns renders where it stands; the caller folds it into a user
        # turn for a template that refuses one (alternating roles only) or leaves it out.
        self.template_renders_inline_system = self._template is not None and self._renders_inline_system()
        self.bos_token_id = self._special_token_id("bos_token")
        self.eos_token_id = self._special_token_id("eos_token")
        self.eos_token_ids: set[int] = {self.eos_token_id} if self.eos_token_id is not None else set()
        # Added tokens can sit above the base vocabulary, so count by the largest id encode may produce.
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        # The ids that decode(skip_special_tokens=True) drops.
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    @classmethod
    def load(cls, model, chat_template: str | None = None) -> Self:
        """The tokenizer of a model as model/loader.py takes it: a Hugging Face folder's path, or a source that
        holds its tokenizer in memory (a GGUF file's: `tokenizer` and `tokenizer_config`)."""
        if isinstance(model, str | Path):
            return cls.from_dir(model, chat_template)
        # taken as it is, not copied: a source is opened for one load (a copy of SmolLM2's costs ~10 MiB at the
        # moment the engine's memory peaks)
        return cls.from_config(model.tokenizer, model.tokenizer_config, chat_template)

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Self:
        """Read a Hugging Face folder; `chat_template` (a template or a file holding one) overrides the folder's."""
        path = Path(path)
        tokenizer = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        jinja_file = path / "chat_template.jinja"
        # transformers 5 saves the template as chat_template.jinja, which wins over tokenizer_config.json's.
        if jinja_file.exists():
            config = config | {"chat_template": jinja_file.read_text(encoding="utf-8")}
        return cls.from_config(tokenizer, config, chat_template)

    @classmethod
    def from_config(cls, tokenizer: HFTokenizer, config: dict, chat_template: str | None = None) -> Self:
        """A `tokenizers` Tokenizer with tokenizer_config.json's contents; `chat_template` overrides theirs."""
        special_tokens = {}
        for name in SPECIAL_TOKENS:
            value = config.get(name)
            # Written either as a plain string or as a serialized AddedToken {"content": ..., "lstrip": ...}.
            content = value.get("content") if isinstance(value, dict) else value
            if content:
                special_tokens[name] = content
        if "add_bos_token" in config or "add_eos_token" in config:
            _set_special_token_flags(tokenizer, special_tokens, config)
        if chat_template is None:
            chat_template = _config_chat_template(config)
        else:
            chat_template = _read_template_arg(chat_template)
        return cls(tokenizer, special_tokens, chat_template)

    def _special_token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return self._tokenizer.token_to_id(token) if token is not None else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Special tokens written in the text ("<|im_start|>") become their single ids, as in transformers.
        if len(text) >= LONG_TEXT:  # the same ids; only a batch lets go of the GIL
            return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` holds it (what other libraries, e.g. the grammar's, read)."""
        return self._tokenizer.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token, also for a token that holds only part of a UTF-8 character."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.id_to_token(token_id) or ""
        if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):  # SentencePiece byte fallback
            return bytes([int(m[1], 16)])
        if piece and all(ch in BYTE_LEVEL for ch in piece):
            return bytes(BYTE_LEVEL[ch] for ch in piece)
        return text.encode()

    def token_text(self, token_id: int) -> str:
        """A token as a string; a partial UTF-8 character is spelled as OpenAI does, e.g. 'bytes:\\xe4\\xbd'."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """`template_kwargs`: more variables for the template (enable_thinking, reasoning_effort), as transformers'
        **kwargs; they never replace the ones set here."""
        if self._template is None:
            raise ValueError(
                "this model has no chat template; pass one with --chat-template (a Jinja template or a file)"
            )
        messages = [_template_message(m) for m in messages]
        try:
            return self._template.render(
                {
                    **(template_kwargs or {}),
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    # transformers always defines these, and templates test `tools is not none`.
                    "tools": tools,
                    "documents": None,
                    **self.special_tokens,
                }
            )
        except Exception as e:
            # The template is the model author's code run on the client's messages: any failure there (including
            # raise_exception) is a bad request, not a server fault.
            raise ValueError(f"chat template error: {e}") from e

    def _renders_inline_system(self) -> bool:
        probe = [
            {"role": role, "content": f"kvserve-probe-{i}-{role}"}
            for i, role in enumerate(("user", "assistant", "system", "user"))
        ]
        try:
            text = self.apply_chat_template(probe, add_generation_prompt=False)
        except ValueError:
            return False
        at = [text.find(m["content"]) for m in probe]
        return -1 not in at and at == sorted(at)


def _byte_level_table() -> dict[str, int]:
    # Byte-level BPE (GPT-2 style) spells each byte as a visible character: printable Latin-1 bytes as
    # themselves, the other 68 bytes as chr(256), chr(257), ... in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


BYTE_LEVEL = _byte_level_table()


def _set_special_token_flags(tokenizer: HFTokenizer, special_tokens: dict[str, str], config: dict) -> None:
    # Like transformers 5: explicit add_bos_token/add_eos_token replace tokenizer.json's post-processor.
    def added(flag: str, name: str) -> list[str]:
        token = special_tokens.get(name)
        known = token is not None and tokenizer.token_to_id(token) is not None
        return [token] if config.get(flag) and known else []

    bos, eos = added("add_bos_token", "bos_token"), added("add_eos_token", "eos_token")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=bos + ["$A"] + eos, special_tokens=[(t, tokenizer.token_to_id(t)) for t in bos + eos]
    )


def _config_chat_template(config: dict) -> str | None:
    template = config.get("chat_template")
    # Several named templates are stored as [{"name": "default", "template": ...}, {"name": "tool_use", ...}].
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _read_template_arg(value: str) -> str:
    # A template always has a tag or a line break; anything else is taken as a file name.
    if "{" in value or "\n" in value:
        return value
    file = Path(value)
    if not file.is_file():
        raise ValueError(f"chat template file not found: {value}")
    return file.read_text(encoding="utf-8")


def _template_message(message: dict) -> dict:
    # As transformers does, drop None values: templates test whether a key is defined, not whether it is None.
    message = {key: value for key, value in message.items() if value is not None}
    content = message.get("content")
    if isinstance(content, list):
        # OpenAI content parts. transformers passes the list as is, which templates written for strings (ChatML
        # among them) reject; join the text parts with newlines as vLLM does.
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise ValueError(f"content part type {part.get('type')!r} is not supported, only 'text'")
            texts.append(part["text"])
        message["content"] = "\n".join(texts)
    return message


class _GenerationTag(jinja2.ext.Extension):
    # {% generation %}...{% endgeneration %} marks assistant text for transformers' training masks; here the body
    # renders as plain template text.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' version: no HTML escaping (Jinja's built-in escapes <, >, &, ') and json.dumps options.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_env() -> jinja2.Environment:
    # The environment transformers renders chat templates in, so outputs match it character for character.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _compile_template(source: str) -> jinja2.Template:
    try:
        return _template_env().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template syntax error (line {e.lineno}): {e.message}") from e


def _template_variables(source: str) -> set[str]:
    """The names a template reads from its context (a compiled template's syntax is known to be fine)."""
    return jinja2.meta.find_undeclared_variables(_template_env().parse(source))


class IncrementalDetokenizer:
    """Turns generated ids into text deltas that never end inside a UTF-8 character.

    Each step decodes only a short window: the ids of the last released delta (context, so that decoders that
    depend on neighbours, such as SentencePiece's leading-space rule and byte fallback, see the same tokens) plus
    the ids not yet released. Without prompt ids, the deltas join to exactly `tokenizer.decode(output ids)`; with
    them, the text continues the prompt (" Paris" after "The capital of France is", where a SentencePiece decode of
    the output alone would drop the space).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window = list(prompt_ids[-PROMPT_CONTEXT_IDS:]) if prompt_ids else []
        self._num_context = len(self._window)  # window[:num_context] was released (or is prompt)
        self._deltas: list[str] = []  # released text; a list so that appending never copies what came before

    def add(self, token_ids: list[int]) -> str:
        # One id at a time, so that ids are held back only while the text really ends inside a character.
        deltas = []
        for token_id in token_ids:
            # Skipped special ids are filtered out before the decoder runs, so they cannot change any text.
            if not (self.skip_special_tokens and token_id in self._tokenizer.special_ids):
                self._window.append(token_id)
                deltas.append(self._release(final=False))
        return "".join(deltas)

    @property
    def text(self) -> str:
        """Everything released so far (joined on each call: per step, use `tail`)."""
        return "".join(self._deltas)

    def tail(self, num_chars: int) -> str:
        """The last `num_chars` characters released, at a cost that does not grow with the text."""
        pieces = []
        for delta in reversed(self._deltas):
            if num_chars <= 0:
                break
            pieces.append(delta[-num_chars:])
            num_chars -= len(delta)
        return "".join(reversed(pieces))

    def flush(self) -> str:
        """At the end of a sequence: release what is still held back, as decode gives it (U+FFFD included)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if len(self._window) == self._num_context:
            return ""
        context_text = self._tokenizer.decode(self._window[: self._num_context], self.skip_special_tokens)
        window_text = self._tokenizer.decode(self._window, self.skip_special_tokens)
        # Hold back while the text ends inside a multi-byte character, or has not grown (a SentencePiece "▁" at
        # the very start decodes to nothing until the next token shows it is a space).
        incomplete = window_text.endswith("\ufffd") or len(window_text) <= len(context_text)
        if incomplete and len(self._window) - self._num_context < MAX_HELD_IDS and not final:
            return ""
        delta = window_text[len(context_text) :]
        # The ids just released are the next step's context; older ones are never decoded again.
        del self._window[: self._num_context]
        self._num_context = len(self._window)
        if delta:
            self._deltas.append(delta)
        return delta
