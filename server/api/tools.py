"""Tool calling, whatever the API that asked: how tools reach the prompt, the grammar that makes a call valid,
and the parser that turns the model's text into calls as it streams.

The model's side is the Hermes convention that many open models are trained on: a call is a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>, and a tool's result comes back
between <tool_response> and </tool_response>. A chat template that knows about tools renders them itself;
for one that does not (SmolLM2's), kvserve writes the tools into the system message and the calls and
results of the history into the turns, in that convention.

tool_choice "required" or a named function is enforced by a grammar built from the functions' JSON schemas,
so a call always names a declared function and its arguments always validate; "auto" lets the model choose,
and the calls it writes are parsed out of its text (with a response_format, the grammar allows either the
formatted answer or calls); "none" leaves the tools out of the prompt, so the model answers in words.
"""

import json
import re
import secrets
import string
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from server.api.schemas import grammar_ready
from server.engine.request import GrammarSpec

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
# a function declared without parameters takes none (OpenAI's rule): its arguments are {}
NO_PARAMETERS = {"type": "object", "properties": {}}
# A call's opening, up to its arguments: {"name": "...", "arguments":
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
# ... and up to its name, when that comes first
CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
# ... and a name cut short inside its string
PARTIAL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)\\?$')
MAX_HEAD_CHARS = 512  # a head not parsed by then is read as a whole call at its end tag


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None = None
    parameters: dict = field(default_factory=lambda: dict(NO_PARAMETERS))  # the arguments' JSON schema
    # the client asked that its calls match the schema whole: keywords no grammar holds are a 400, not ignored
    strict: bool = False


@dataclass(frozen=True)
class Tools:
    functions: list[Function]
    choice: str = "auto"  # none | auto | required | the name of the function to call
    parallel: bool = True  # more than one call in a reply

    @property
    def active(self) -> bool:
        """The model is told about the tools and its calls are parsed."""
        return self.choice != "none" and bool(self.functions)

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (transformers' `tools`), or None when none are offered."""
        if not self.active:
            return None
        return [{"type": "function", "function": _function_dict(f)} for f in self.functions]


def _function_dict(f: Function) -> dict:
    d = {"name": f.name, "description": f.description, "parameters": f.parameters}
    return {k: v for k, v in d.items() if v is not None}


def new_call_id(prefix: str = "call_") -> str:
    alphabet = string.ascii_letters + string.digits
    return prefix + "".join(secrets.choice(alphabet) for _ in range(24))


# --- the prompt ----------------------------------------------------------------------------------------


def tool_prompt(tools: Tools) -> str:
    """What a system message says about the tools, for templates that do not render tools themselves."""
    listed = "\n".join(
        json.dumps({"type": "function", "function": _function_dict(f)}) for f in tools.functions
    )
    return (
        "You can call functions to answer. They are listed in JSON between <tools> and </tools>:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, write a JSON object with its name and its arguments between <tool_call> and "
        "</tool_call>, like this:\n"
        '<tool_call>\n{"name": "the function\'s name", "arguments": {"an argument": "its value"}}\n</tool_call>\n'
        "Function results come back between <tool_response> and </tool_response>."
    )


def call_text(name: str, arguments) -> str:
    """One call as the model writes it; `arguments` is a JSON string (OpenAI's shape) or an object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # written as it came
    return (
        f"{CALL_START}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_END}"
    )


def render_history(messages: list[dict], tools: Tools | None, template_has_tools: bool) -> list[dict]:
    """Chat messages (OpenAI's shape: assistant `tool_calls`, `tool` results) as the template will take them.

    A template that renders tools gets the calls with their arguments as objects (transformers' convention) and
    the `tool` messages as they are. For any other template, the tools go into the system message, a call
    becomes its text in the assistant's turn and consecutive results one user turn of <tool_response> blocks.
    """
    if template_has_tools:
        return [_with_object_arguments(m) for m in messages]
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            text = "\n".join(filter(None, [_text(m.get("content")), *calls]))
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append(m)
    for m in out:
        m.pop("tool_results", None)
    if tools is not None and tools.active:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{_text(out[0]['content'])}\n\n{tool_prompt(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": tool_prompt(tools)})
    return out


def _text(content) -> str:
    if isinstance(content, list):  # OpenAI text parts
        return "\n".join(part["text"] for part in content)
    return content or ""


def _with_object_arguments(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        arguments = c["function"]["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append({**c, "function": {**c["function"], "arguments": arguments}})
    return {**m, "tool_calls": calls}


# --- the grammar ---------------------------------------------------------------------------------------


def output_grammar(
    tools: Tools | None, answer_schema: dict | None, answer_strict: bool = False
) -> GrammarSpec | None:
    """The grammar of the reply, or None when it is free text.

    required: one or more calls (one if not parallel); a named function: one call of it; auto: free text,
    unless a response_format asks for JSON, then either that JSON or calls; none: the JSON if asked for.
    Keywords no grammar can hold (uniqueItems, not, if) are ignored unless a schema in it is strict (a 400 then).
    """
    answer_schema = None if answer_schema is None else grammar_ready(answer_schema)
    if tools is None or not tools.active:
        if answer_schema is None:
            return None
        return GrammarSpec("json_schema", json.dumps(answer_schema), lenient=not answer_strict)
    if tools.choice == "auto" and answer_schema is None:
        return None
    functions = tools.functions
    if tools.choice not in ("auto", "required"):
        functions = [f for f in functions if f.name == tools.choice]
    calls = {
        "open": f"{CALL_START}\n",
        "close": f"\n{CALL_END}",
        "separator": "\n",
        "calls": [_call_schema(f) for f in functions],
        "many": tools.parallel and tools.choice in ("auto", "required"),
        "or_json": answer_schema if tools.choice == "auto" else None,  # here with a response_format
    }
    strict = any(f.strict for f in functions) or (answer_strict and calls["or_json"] is not None)
    return GrammarSpec("tool_calls", json.dumps(calls), lenient=not strict)


def _call_schema(f: Function) -> dict:
    arguments = grammar_ready(f.parameters)
    # its own base, so that its "#/$defs/..." resolve in it, not in the call around it
    if "$id" not in arguments:
        arguments = {"$id": f"urn:kvserve:tool:{urllib.parse.quote(f.name, safe='')}", **arguments}
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# --- the parser ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class CallDelta:
    """A piece of one tool call: its first piece has the id and name, the others more argument text."""

    index: int  # of the call within its reply
    id: str | None
    name: str | None
    arguments: str


@dataclass
class ToolCallParser:
    """Splits a reply's text, as it streams, into content and tool calls.

    feed() takes each text delta and returns the content to send and the call pieces: a call's id and name as
    soon as its opening is written, then its arguments as they are generated. Text that may be the start of a
    call, and whitespace next to calls, is held back until it is clear. A block that is not a valid call of a
    declared function stays content, as written. A reply that ends inside a call (max_tokens) keeps what it
    wrote of the call: its partial arguments once its name is out (as OpenAI's API returns them), a call with
    no arguments where its name was cut short but can begin only one declared function (a forced call cut at
    its first tokens is still that call), nothing of another opening cut short, nor of a tag cut short; the
    model's markup never becomes content.
    """

    names: set[str]
    new_id: Callable[[], str] = new_call_id
    parallel: bool = True
    num_calls: int = 0
    _buffer: str = ""
    _gap: str = ""  # the whitespace before the latest <tool_call>
    _state: str = "text"  # text | head | arguments | tail | done
    _started: bool = False  # the arguments' JSON value has begun
    _depth: int = 0  # its nesting; back to 0 when it closed
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str, final: bool = False, cut: bool = False) -> tuple[str, list[CallDelta]]:
        """cut: the reply ends here at its max_tokens (with final)."""
        self._buffer += text
        content: list[str] = []
        calls: list[CallDelta] = []
        steps = {
            "text": self._text,
            "head": self._head,
            "arguments": self._arguments,
            "tail": self._tail,
            "done": self._done,
        }
        while steps[self._state](content, calls, final):
            pass
        if final:
            content.append(self._flush(cut))
        return "".join(content), calls

    def _text(self, content: list[str], calls: list[CallDelta], final: bool) -> bool:
        start = self._buffer.find(CALL_START)
        if start >= 0:
            before = self._buffer[:start]
            kept = before.rstrip()
            content.append(kept)
            self._gap = before[len(kept) :]  # put back if the block is not a call
            self._buffer = self._buffer[start + len(CALL_START) :]
            self._state = "head"
            return True
        if final:
            return False
        # Hold back what may begin a call, and trailing whitespace (it goes if a call follows).
        keep = _partial_suffix(self._buffer, CALL_START)
        send = self._buffer[: len(self._buffer) - keep]
        stripped = send.rstrip()
        content.append(stripped)
        self._buffer = self._buffer[len(stripped) :]
        return False

    def _head(self, content: list[str], calls: list[CallDelta], final: bool) -> bool:
        m = CALL_HEAD.match(self._buffer)
        name = None
        if m:
            try:
                name = json.loads(m.group(1))
            except json.JSONDecodeError:
                pass
        if name in self.names:
            calls.append(CallDelta(self.num_calls, self.new_id(), name, ""))
            self._buffer = self._buffer[m.end() :]
            self._state, self._depth, self._started = "arguments", 0, False
            return True
        if m or CALL_END in self._buffer or len(self._buffer) > MAX_HEAD_CHARS or final:
            return self._whole_call(content, calls, final)
        return False

    def _whole_call(self, content: list[str], calls: list[CallDelta], final: bool) -> bool:
        """A block whose opening did not parse: read it whole at its end tag (e.g. arguments before name)."""
        end = self._buffer.find(CALL_END)
        if end < 0 and not final:
            return False
        body = self._buffer[:end] if end >= 0 else self._buffer
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            call = None
        if (
            isinstance(call, dict)
            and call.get("name") in self.names
            and isinstance(call.get("arguments"), dict)
        ):
            arguments = json.dumps(call["arguments"], ensure_ascii=False)
            calls.append(CallDelta(self.num_calls, self.new_id(), call["name"], arguments))
            self._end_call()
        elif end < 0 and self._cut_short(body):  # the reply ended while the call's opening was written
            name = self._only_name(body)
            if name is not None:  # the one declared function it can be: a call of it, its arguments not begun
                calls.append(CallDelta(self.num_calls, self.new_id(), name, ""))
                self._state = "done"  # the reply ends here: a call cut short, as one cut in its arguments
            else:
                self._state = "text"
        else:  # not a call: the text stays as the model wrote it
            content.append(self._gap + CALL_START + body + (CALL_END if end >= 0 else ""))
            self._state = "text"
        self._buffer = self._buffer[end + len(CALL_END) :] if end >= 0 else ""
        return True

    def _cut_short(self, body: str) -> bool:
        """Whether `body`, the rest of a reply after <tool_call>, is a call's opening cut short: blank, or an
        object whose name is a declared function's or not yet written out."""
        if body.strip() and not body.lstrip().startswith("{"):
            return False
        named = CALL_NAME.match(body)
        if named is None:
            return True
        try:
            return json.loads(named.group(1)) in self.names
        except json.JSONDecodeError:
            return False

    def _only_name(self, body: str) -> str | None:
        """The declared function a call's opening cut short names, where only one can be meant: its name
        written out, or the part of it written so far (none yet: "") beginning one declared name and no other."""
        if named := CALL_NAME.match(body):
            return json.loads(named.group(1))  # a declared one: _cut_short said so
        if partial := PARTIAL_NAME.match(body):
            try:
                prefix = json.loads(f'"{partial.group(1)}"')
            except json.JSONDecodeError:
                return None
        elif '{"name":"'.startswith("".join(body.split())):
            prefix = ""
        else:
            return None
        candidates = [n for n in self.names if n.startswith(prefix)]
        return candidates[0] if len(candidates) == 1 else None

    def _arguments(self, content: list[str], calls: list[CallDelta], final: bool) -> bool:
        skipped = n = 0  # whitespace before the value; characters read
        closed = False
        for ch in self._buffer:
            n += 1
            if not self._started:
                if ch.isspace():
                    skipped += 1
                    continue
                self._started = True
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
            if self._depth == 0 and not self._in_string:
                closed = True
                break
        piece, self._buffer = self._buffer[skipped:n], self._buffer[n:]
        if piece:
            calls.append(CallDelta(self.num_calls, None, None, piece))
        if closed:
            self._state = "tail"
        return closed

    def _tail(self, content: list[str], calls: list[CallDelta], final: bool) -> bool:
        end = self._buffer.find(CALL_END)
        if end < 0:
            return False  # the closing brace and tag are still to come; nothing of them is content
        self._buffer = self._buffer[end + len(CALL_END) :]
        self._end_call()
        return True

    def _end_call(self) -> None:
        self.num_calls += 1
        self._state = "text" if self.parallel else "done"

    def _done(self, content: list[str], calls: list[CallDelta], final: bool) -> bool:
        self._buffer = ""  # one call asked for: what follows it is dropped
        return False

    def _flush(self, cut: bool) -> str:
        """At the end of the reply: what is still held back. Whitespace next to calls goes, and where max_tokens
        cut the reply, a tag cut short with the blank space before it."""
        rest, self._buffer = self._buffer, ""
        if self._state == "text":
            tag = _partial_suffix(rest, CALL_START) if cut else 0
            if tag:
                return rest[:-tag].rstrip()
            return rest if not self.num_calls else rest.rstrip()
        if self._state == "head":  # an opening cut short: it stays content
            return self._gap + CALL_START + rest
        return ""


# --- Gemma 4's calls -------------------------------------------------------------------------------------

GEMMA4_QUOTE = '<|"|>'  # Gemma 4's strings are between two of these (one token of its tokenizer)
GEMMA4_HEAD = re.compile(r"\s*call:([\w.\-]+)\{")
NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")


def gemma4_call(body: str) -> tuple[str | None, dict | None]:
    """A call as Gemma 4 writes it between its markers, `call:NAME{key:value,...}`: (name, arguments), or (None,
    None) where it does not parse. Values are strings between <|"|>, numbers, true, false, null, {objects} and
    [lists]; keys are bare."""
    head = GEMMA4_HEAD.match(body)
    if head is None:
        return None, None
    reader = _Gemma4Reader(body, head.end())
    try:
        arguments = reader.members("}")
        if body[reader.at :].strip():
            raise ValueError("text after the arguments")
    except (ValueError, IndexError):
        return head[1], None
    return head[1], arguments


@dataclass
class _Gemma4Reader:
    """Reads Gemma 4's argument syntax from `at` on."""

    text: str
    at: int

    def members(self, close: str) -> dict:
        out = {}
        while True:
            self._space()
            if self.text[self.at] == close:
                self.at += 1
                return out
            colon = self.text.index(":", self.at)
            key = self.text[self.at : colon].strip().removeprefix(GEMMA4_QUOTE).removesuffix(GEMMA4_QUOTE)
            if not key:
                raise ValueError("an empty key")
            self.at = colon + 1
            out[key] = self.value()
            self._separator(close)

    def items(self) -> list:
        out = []
        while True:
            self._space()
            if self.text[self.at] == "]":
                self.at += 1
                return out
            out.append(self.value())
            self._separator("]")

    def value(self):
        self._space()
        if self.text.startswith(GEMMA4_QUOTE, self.at):
            end = self.text.index(GEMMA4_QUOTE, self.at + len(GEMMA4_QUOTE))
            value, self.at = self.text[self.at + len(GEMMA4_QUOTE) : end], end + len(GEMMA4_QUOTE)
            return value
        if self.text[self.at] in "{[":
            self.at += 1
            return self.members("}") if self.text[self.at - 1] == "{" else self.items()
        end = self.at
        while end < len(self.text) and self.text[end] not in ",}]":
            end += 1
        bare, self.at = self.text[self.at : end].strip(), end
        literals = {"true": True, "false": False, "null": None}
        if bare in literals:
            return literals[bare]
        if NUMBER.fullmatch(bare):
            return json.loads(bare)
        if not bare:
            raise ValueError("a missing value")
        return bare  # a word the model left unquoted: the string it meant

    def _separator(self, close: str) -> None:
        self._space()
        if self.text[self.at] == ",":
            self.at += 1
        elif self.text[self.at] != close:
            raise ValueError(f"expected , or {close}")

    def _space(self) -> None:
        while self.text[self.at].isspace():
            self.at += 1


def call_parser(tools: Tools | None, new_id: Callable[[], str] = new_call_id) -> ToolCallParser | None:
    """The parser for one reply to a request that offers `tools`; None when no calls are to be parsed."""
    if tools is None or not tools.active:
        return None
    return ToolCallParser({f.name for f in tools.functions}, new_id=new_id, parallel=tools.parallel)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
