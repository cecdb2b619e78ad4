"""Reasoning, whatever the API that asked: which format a thinking model writes it in (chosen once, from its chat
template or --reasoning-parser), what the engine is told about it, and the parser that splits each reply, as it
streams, into reasoning, answer text and tool calls, by token ids.

Three formats, each known by marker tokens that must be single tokens of the tokenizer (else the format cannot be
parsed and the reasoning stays in the answer, as before):
- think (Qwen3, the DeepSeek-R1 distills, SmolLM3): reasoning between `<think>` and `</think>`, then the answer.
  The chat template decides where the reply starts: a generation prompt that opens `<think>` (R1 distills,
  Qwen3-Thinking-2507) starts it inside the reasoning; one that opens and closes it (Qwen3 with enable_thinking
  false) leaves none; one with neither leaves it to the model's first token.
- gemma4 (Gemma 4): think's shape with its own markers, `<|channel>thought\n...<channel|>`; the channel's label
  (`thought\n`) is not reasoning and is dropped. Its calls are its own too, read here by their marker tokens:
  `<|tool_call>call:NAME{key:value,...}<tool_call|>`, strings between `<|"|>` (server/api/tools.py's
  gemma4_arguments reads the arguments).
- harmony (GPT-OSS): messages `<|start|>assistant<|channel|>NAME<|message|>...<|end|>`; `analysis` is the
  reasoning, `final` the answer, and a `commentary` message to `functions.NAME` (in its header) a tool call whose
  body is the arguments' JSON, ended by `<|call|>`.

The engine leaves the marker tokens out of the text and says where they fell (RequestOutput.marks), so the parser
reads ids, never the text's look-alikes: a model that writes the characters "</think>" in its answer wrote text.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from server.api.config import REASONING_ALIASES, REASONING_PARSERS
from server.api.errors import ApiError
from server.api.tools import CallDelta, ToolCallParser, Tools, gemma4_call, new_call_id
from server.engine.request import FinishReason, ReasoningSpec, RequestOutput, SamplingParams

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# the formats of reasoning between two markers: (opening, closing, the label the opening is followed by)
TAGS = {"think": (THINK_OPEN, THINK_CLOSE, ""), "gemma4": ("<|channel>", "<channel|>", "thought\n")}
# Gemma 4's call markers: a call's opening and end, and its strings' delimiter (optional: without them as single
# tokens its calls are not read)
GEMMA4_CALL, GEMMA4_CALL_END, GEMMA4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
# Harmony's end of reasoning: the answer's header, and what the model writes to close its analysis and open it
HARMONY_ANSWER, HARMONY_CLOSE = "<|channel|>final<|message|>", "<|end|><|start|>assistant"
RECIPIENT = re.compile(r"to=([^\s<]+)")
MIN_BUDGET = 1024  # Anthropic's least budget_tokens


@dataclass(frozen=True)
class ReasoningFormat:
    """A model's reasoning format, with its marker tokens' ids in the tokenizer."""

    name: str  # think | gemma4 | harmony
    ids: dict[str, int]  # marker text -> its token id
    answer: tuple[int, ...] = ()  # harmony: the answer's header tokens
    close: tuple[int, ...] = ()  # what closes the reasoning when the budget runs out

    @property
    def tags(self) -> tuple[str, str, str]:
        """A format of reasoning between two markers: (opening, closing, the label after the opening)."""
        return TAGS[self.name]

    @property
    def markers(self) -> frozenset[int]:
        return frozenset(self.ids.values())

    @property
    def history_key(self) -> str:
        """Where templates read an earlier turn's reasoning: GPT-OSS's `thinking`, Qwen3's `reasoning_content`."""
        return "thinking" if self.name == "harmony" else "reasoning_content"

    def start(self, generation_prompt: list[int]) -> str:
        """Where a reply starts, from the tokens the template adds for it: in (reasoning), out (none), or open
        (the model's first token decides)."""
        if self.name == "harmony":
            return "in"  # its reply opens with a message's header; the answer's header ends any reasoning
        opening, closing = (self.ids[tag] for tag in self.tags[:2])
        last = [t for t in generation_prompt if t in (opening, closing)]
        if not last:
            return "open"
        return "in" if last[-1] == opening else "out"

    def spec(self, start: str, budget: int | None) -> ReasoningSpec | None:
        """What the engine is told: None where the reply holds no reasoning."""
        if start == "out":
            return None
        if self.name == "harmony":
            return ReasoningSpec(self.answer, None, budget, self.close)
        opening, closing = (self.ids[tag] for tag in self.tags[:2])
        opens_with = opening if start == "open" else None
        return ReasoningSpec((closing,), opens_with, budget, (closing,))


def choose_format(tokenizer, name: str = "auto") -> tuple[ReasoningFormat | None, str]:
    """The reasoning format to parse replies by, and why (for the log): `name` as --reasoning-parser gives it;
    auto reads the chat template. A format whose marker tokens the tokenizer lacks is none: its reasoning stays
    in the answer."""
    name = REASONING_ALIASES.get(name, name)
    if name not in REASONING_PARSERS:
        known = ", ".join([*REASONING_PARSERS, *REASONING_ALIASES])
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {known}")
    if name == "none":
        return None, "--reasoning-parser none"
    template = tokenizer.chat_template or ""
    if name == "auto":
        if "<|channel|>" in template:
            name = "harmony"
        elif "<channel|>" in template:
            name = "gemma4"
        elif THINK_CLOSE in template or THINK_OPEN in template:
            name = "think"
        else:
            return None, "the chat template writes no reasoning markers"
    markers = HARMONY if name == "harmony" else TAGS[name][:2]
    ids = {m: single_token(tokenizer, m) for m in markers}
    missing = [m for m, i in ids.items() if i is None]
    if missing:
        return None, f"{name}: the tokenizer has no single token for {', '.join(missing)}"
    if name in TAGS:
        opening, closing, label = TAGS[name]
        why = f"{name}: {opening}{label.strip()} ... {closing}"
        if name == "gemma4":
            calls = {m: single_token(tokenizer, m) for m in (GEMMA4_CALL, GEMMA4_CALL_END, GEMMA4_QUOTE)}
            if None not in calls.values():
                ids |= calls
                why += f", calls {GEMMA4_CALL}...{GEMMA4_CALL_END}"
        return ReasoningFormat(name, ids), why
    answer = tuple(tokenizer.encode(HARMONY_ANSWER))
    close = tuple(tokenizer.encode(HARMONY_CLOSE)) + answer
    return ReasoningFormat(name, ids, answer, close), "harmony: analysis, commentary and final channels"


def single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else None


def reason(
    params: SamplingParams, format: ReasoningFormat | None, start: str, budget: int | None = None
) -> None:
    """Tell the engine about the reply's reasoning (SamplingParams.reasoning, marker_token_ids): its grammar then
    constrains the answer alone, and `budget` bounds the reasoning."""
    if format is None:
        return
    params.marker_token_ids = format.markers
    params.reasoning = format.spec(start, budget)


def check_budget(budget: int, param: str) -> None:
    """Anthropic's least thinking.budget_tokens. (A budget of max_tokens or more, which Anthropic refuses unless
    thinking is interleaved with tool calls, is taken: max_tokens bounds the thinking and the answer together.)"""
    if budget < MIN_BUDGET:
        raise ApiError(400, f"{param}: must be at least {MIN_BUDGET}, got {budget}", param=param)


# --- the parser ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Piece:
    """A stretch of one reply: reasoning text, answer text, or a piece of a tool call."""

    kind: str  # reasoning | content | call
    text: str = ""
    call: CallDelta | None = None


@dataclass
class ReplyParser:
    """Splits one reply, as its engine outputs come, into pieces in order: reasoning, answer text and tool calls.
    Answer text goes through the tool-call parser when tools are offered (calls written as text); harmony's own
    calls are messages, parsed here. Counts the reasoning's tokens."""

    format: ReasoningFormat | None
    start: str = "out"  # in | out | open: ReasoningFormat.start
    calls: ToolCallParser | None = None  # the answer's calls, written as text
    tool_names: set[str] = field(default_factory=set)  # harmony, gemma4: the functions a call may name
    new_id: Callable[[], str] = new_call_id
    num_reasoning_tokens: int = 0
    num_calls_written: int = 0  # harmony's and gemma4's calls
    _state: str = "content"  # think: reasoning | content; harmony: header | body | between
    _first: bool = True
    _header: str = ""  # harmony: the message's header text so far
    _header_tokens: int = 0
    _body: str = ""  # harmony: reasoning | content | call | none (a call of no offered function: dropped)
    _call_index: int = 0  # harmony: the open call's index in the reply
    _label: str | None = None  # gemma4: the reasoning's first text so far, while it may still be the label
    _call: str | None = None  # gemma4: the open call's text so far (None: no call open)
    _cut: bool = False  # the reply being fed ended at its max_tokens

    def __post_init__(self):
        if self.format is not None and self.format.name == "harmony":
            self._state = "header"
        elif self.format is not None and self.start == "in":
            self._state = "reasoning"
            self._label = ""

    @property
    def num_calls(self) -> int:
        return self.num_calls_written + (self.calls.num_calls if self.calls is not None else 0)

    def feed(self, out: RequestOutput) -> list[Piece]:
        pieces: list[Piece] = []
        # the reply ends at its max_tokens: a call or tag it was writing is cut short, and none of it is content
        self._cut = out.finished and out.finish_reason is FinishReason.LENGTH
        if self.format is None:
            self._content(pieces, out.text, out.finished)
            return pieces
        # the text between marks belongs to the ids between the marker ids, in order
        marks, cut = iter(out.marks), 0
        markers = self.format.markers
        for token_id in out.new_token_ids:
            if token_id in markers:
                offset, marked = next(marks, (None, None))
                if marked != token_id:  # the output ended at a stop string before this marker
                    break
                self._text(pieces, out.text[cut:offset])
                cut = offset
                self._marker(pieces, token_id)
            else:
                self._count_token()
            self._first = False
        self._text(pieces, out.text[cut:])
        if out.finished:
            # a call the model ended unclosed: its text, as written (one max_tokens cut: nothing of it)
            if self._call is not None and not self._cut:
                self._content(pieces, GEMMA4_CALL + self._call)
            self._call = None
            self._content(pieces, "", final=True)
        return _joined(pieces)

    # think and harmony alike: which stretch the tokens and text go to

    def _count_token(self) -> None:
        if self.format.name != "harmony":
            self.num_reasoning_tokens += self._state == "reasoning"
        elif self._state == "header":
            self._header_tokens += 1
        else:
            self.num_reasoning_tokens += self._body == "reasoning"

    def _text(self, pieces: list[Piece], text: str) -> None:
        if not text:
            return
        if self.format.name != "harmony":
            if self._call is not None:
                self._call += text
            elif self._state == "reasoning":
                self._reasoning(pieces, text)
            else:
                self._content(pieces, text)
            return
        if self._state == "header":
            self._header += text
        elif self._state == "body" and self._body == "reasoning":
            pieces.append(Piece("reasoning", text))
        elif self._state == "body" and self._body == "call":
            pieces.append(Piece("call", call=CallDelta(self._call_index, None, None, text)))
        elif self._body != "none":  # the final channel, a preamble, or text outside any message
            self._content(pieces, text)

    def _reasoning(self, pieces: list[Piece], text: str) -> None:
        """Reasoning text, less the label its opening is followed by (Gemma 4's "thought\n"): held back while
        what came may still be the label, the label dropped once it came whole, all of it kept if not."""
        label = self.format.tags[2]
        if self._label is not None and label:
            self._label += text
            if label.startswith(self._label) and len(self._label) < len(label):
                return
            text = self._label.removeprefix(label)
            self._label = None
        if text:
            pieces.append(Piece("reasoning", text))

    def _content(self, pieces: list[Piece], text: str, final: bool = False) -> None:
        if self.calls is None:
            if text:
                pieces.append(Piece("content", text))
            return
        content, calls = self.calls.feed(text, final, cut=final and self._cut)
        # Within one feed, the pieces that go on with the open call come first, then the content (it can only
        # follow a call's end), then new calls.
        n = 0
        while n < len(calls) and calls[n].id is None:
            n += 1
        pieces += [Piece("call", call=c) for c in calls[:n]]
        if content:
            pieces.append(Piece("content", content))
        pieces += [Piece("call", call=c) for c in calls[n:]]

    def _marker(self, pieces: list[Piece], token_id: int) -> None:
        ids = self.format.ids
        if self.format.name != "harmony":
            opening, closing = (ids[tag] for tag in self.format.tags[:2])
            if token_id in (ids.get(GEMMA4_CALL), ids.get(GEMMA4_CALL_END), ids.get(GEMMA4_QUOTE)):
                self._gemma4_call(pieces, token_id)
            elif token_id == opening and self._state == "content" and self._first and self.start == "open":
                self._state, self._label = "reasoning", ""
                self.num_reasoning_tokens += 1
            elif token_id == closing and self._state == "reasoning":
                if self._label:  # held back as a part of the label, which never came whole: reasoning
                    pieces.append(Piece("reasoning", self._label))
                self._state, self._label = "content", None
                self.num_reasoning_tokens += 1
            return
        if token_id == ids["<|start|>"]:
            self._state, self._header, self._header_tokens = "header", "", 0
        elif token_id in (ids["<|channel|>"], ids["<|constrain|>"]) and self._state == "header":
            self._header += " " if token_id == ids["<|constrain|>"] else " <|channel|>"
        elif token_id == ids["<|message|>"] and self._state == "header":
            self._open_body(pieces)
        elif token_id in (ids["<|end|>"], ids["<|call|>"], ids["<|return|>"]) and self._state == "body":
            if self._body == "reasoning":
                self.num_reasoning_tokens += 1
            if self._body == "call":
                self.num_calls_written += 1
            self._state = "between"

    def _gemma4_call(self, pieces: list[Piece], token_id: int) -> None:
        """Gemma 4's call markers: the opening starts a call's text, a quote marker is written into it, the end
        reads it whole: a call of an offered function with arguments that parse, else the text as written."""
        ids = self.format.ids
        if token_id == ids[GEMMA4_CALL]:
            if self._call is not None:  # an opening inside a call: the first was not one
                self._content(pieces, GEMMA4_CALL + self._call)
            self._call = ""
        elif self._call is None:  # a quote or an end outside a call: text
            self._content(pieces, GEMMA4_QUOTE if token_id == ids[GEMMA4_QUOTE] else GEMMA4_CALL_END)
        elif token_id == ids[GEMMA4_QUOTE]:
            self._call += GEMMA4_QUOTE
        else:
            body, self._call = self._call, None
            name, arguments = gemma4_call(body)
            if name in self.tool_names and arguments is not None:  # as other calls stream: the name, then
                # its arguments
                pieces.append(Piece("call", call=CallDelta(self.num_calls, self.new_id(), name, "")))
                arguments = json.dumps(arguments, ensure_ascii=False)
                pieces.append(Piece("call", call=CallDelta(self.num_calls, None, None, arguments)))
                self.num_calls_written += 1
            else:
                self._content(pieces, GEMMA4_CALL + body + GEMMA4_CALL_END)

    def _open_body(self, pieces: list[Piece]) -> None:
        """A message's header is whole: what its body is (the role and recipient before or after the channel)."""
        before, _, channel = self._header.partition("<|channel|>")
        channel_name = channel.split()[0] if channel.split() else ""
        recipient = RECIPIENT.search(self._header)
        self._state = "body"
        if recipient is not None and recipient[1].startswith("functions."):
            name = recipient[1].removeprefix("functions.")
            if name in self.tool_names:
                self._body, self._call_index = "call", self.num_calls
                pieces.append(Piece("call", call=CallDelta(self._call_index, self.new_id(), name, "")))
            else:
                self._body = "none"
        elif (
            channel_name == "analysis" or recipient is not None
        ):  # built-in tools' calls: part of its thinking
            self._body = "reasoning"
            self.num_reasoning_tokens += self._header_tokens + 2  # the header with its two markers
        else:  # final, or commentary to the user (a preamble)
            self._body = "content"


def _joined(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of one kind as one (text), as the APIs' deltas carry them."""
    out: list[Piece] = []
    for p in pieces:
        if out and p.kind == out[-1].kind and p.kind != "call":
            out[-1] = Piece(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out


def reply_parser(
    format: ReasoningFormat | None,
    start: str,
    tools: Tools | None,
    calls: ToolCallParser | None,
    new_id: Callable[[], str] = new_call_id,
) -> ReplyParser:
    """The parser of one reply: `calls` parses calls written as text in the answer (None: no tools offered), as
    every format may write them there (harmony too, where a forced call's grammar writes it in the final
    channel); harmony's own calls are its messages to functions."""
    names = {f.name for f in tools.functions} if tools is not None and tools.active else set()
    return ReplyParser(format, start, calls, names, new_id)
