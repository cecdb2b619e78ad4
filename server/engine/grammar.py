"""Grammar-constrained decoding with llguidance: compiling what a request asks for, and its per-request state.

A request that asks for structure (a JSON schema, a regex, a choice, a grammar) carries a CompiledGrammar in its
SamplingParams. The engine gives each such request its own GrammarState (a copy of the compiled matcher). Each
step the runner asks the states of the rows it samples for their allowed tokens (a bitmask, one bit per token
id) and the sampler sends everything else to -inf; the output stage feeds each drawn token back to its state
and ends the request when the grammar is complete. The state holds what the output holds, so it survives
preemption: recomputing a request's tokens draws nothing the state has not already taken.

Compiling (~1 ms for a typical schema, more for large ones) happens on the caller's thread, off the event
loop and off the stepping thread; results are cached by what was asked, so a repeated schema costs nothing.
llguidance's limits bound the compile and each step's mask; a GBNF grammar's conversion to Lark, which is
Python, runs in a child process with a time limit (gbnf_to_lark); how deep a grammar nests, which llguidance
does not bound (past its thread's stack the process dies), is bounded here first (MAX_DEPTH).
"""

import json
import logging
import operator
import re
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate, compress, repeat

import llguidance
import torch
from llguidance.gbnf_to_lark import is_lark_syntax

from model.tokenizer import Tokenizer
from server.engine.request import GrammarSpec

log = logging.getLogger(__name__)

# The layout of JSON that constrained outputs take (llguidance's JSON options): compact, with one space after ','
# and ':' as models write it. Flexible whitespace would let a small model spend its whole budget on blank space.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept, by request
# A request's grammar is ready, or the request refused, this long after its body arrived (its parsing counts: a
# 2 MB schema takes a while to read; AsyncEngine.compile_grammar waits what is left)
COMPILE_SECONDS = 1.5
GBNF_SECONDS = 1.2  # a GBNF grammar's conversion to Lark, at most: inside the compile's budget
# A spec this small, unless GBNF, compiles in milliseconds whatever it asks for (is_quick)
QUICK_BYTES = 8192
# How deep llguidance's compilers may recurse for a grammar, in levels as lark_depth and json_depth count them.
# They recurse along rule, terminal and $ref chains and into nested groups with no limit of their own, and a
# grammar deeper than the thread's stack kills the process (SIGSEGV), not just its request.
# Measured on llguidance 1.9.1 with 8 MB stacks (Linux's default, main and pool threads alike), it crashed at:
# a chain of Lark rules 2,679 levels (fine at 2,670), of terminals 3,527 (3,514), of rules each in 28 nested
# groups 4,555 (4,497), of JSON $refs 2,496 (2,490), of $refs each under a property 2,778 (2,769), of $refs in a
# tool's schema (%json) 2,499 (2,493); of $refs to $anchors, 3,000 $refs. The limit is 42% of the lowest, as low
# as lets a 1,000-rule GBNF chain (1,002 levels once converted) compile as it did before depth was checked.
MAX_DEPTH = 1050
# What llguidance's Lark lexer reads as one lexeme holding characters that mean nothing to its parser (a
# string, a comment, a regex, a special token; each unrolled: a 4 MB grammar of them is one C pass, ~0.2 s),
# and %json, which a JSON value follows
_LARK_OPAQUE = re.compile(
    r'"[^"\\]*(?:\\.[^"\\]*)*"i?|(?:#|//)[^\n]*|/[^/\\]*(?:\\.[^/\\]*)*/[imslux]*|<[^<>\s]+>|%json\s*'
)
# Once those are blanked: a definition's head (rule or terminal, `?`/`!` and llguidance's [attributes] allowed;
# llguidance wants each at a line's start), whose name is the group; or a directive (%ignore, %llguidance ...)
_LARK_HEAD = re.compile(r"(?m)^[ \t]*(?:[?!]?([A-Za-z_]\w*)[ \t]*(?:\[[^\[\]:\n]*\])?[ \t]*:|%)")
_LARK_NAME = re.compile(r"[A-Za-z_]\w*|@\d+")  # what a body may name: a definition, or %json block @i
_BRACKET = re.compile(r"[()\[\]{}]")
_NOT_BRACKET = re.compile(r"[^()\[\]{}]+")
_BRACKET_KIND = str.maketrans("[{]}", "(())")
_NAMING = re.compile(r"[A-Za-z_@]")
# llguidance's own converter, run in a child process: it reads GBNF on stdin and writes Lark, or its error
_GBNF_TO_LARK = """import sys
from llguidance.gbnf_to_lark import gbnf_to_lark
try:
    lark = gbnf_to_lark(sys.stdin.buffer.read().decode())
except Exception as e:
    sys.stderr.write(str(e))
    sys.exit(1)
sys.stdout.buffer.write(lark.encode())
"""


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar, ready to hand out per-request states."""

    spec: GrammarSpec
    template: llguidance.LLMatcher  # never advanced itself: each request takes a copy

    def new_state(self) -> "GrammarState":
        return GrammarState(self.template.deep_copy())


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` ([ceil(V / 32)] int32, contiguous, on the CPU)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance by the drawn token; False if the grammar does not allow it or fails on it (then the state is
        broken)."""
        return self.matcher.consume_token(token_id) and not self.matcher.is_error()

    def forced_tokens(self) -> list[int]:
        """The tokens that must come next whatever the model says (a JSON key, a tool call's fixed fields)."""
        return self.matcher.compute_ff_tokens()

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of token_ids, in order, the grammar takes from here (nothing is advanced)."""
        return self.matcher.validate_tokens(token_ids)

    def masks_along(self, token_ids: list[int], rows: torch.Tensor) -> None:
        """Fill rows[j] with the allowed tokens after token_ids[:j], for each j in 0..len(token_ids) (rows
        [len + 1, ceil(V / 32)]); the state ends where it began. token_ids were a valid prefix when drafted; if
        the grammar fails on one now (its per-token budget ran out), the rows from there get the failed state's
        mask (the end only) and the state stays failed: the output stage ends the request with the error."""
        consumed = 0
        for j, row in enumerate(rows):
            self.fill_bitmask(row)
            if j < len(token_ids) and not self.is_broken:
                consumed += self.matcher.consume_token(token_ids[j])
        if consumed and not self.is_broken:
            self.matcher.rollback(consumed)

    @property
    def is_complete(self) -> bool:
        """Nothing more may follow: the output ends here (llguidance's "stopped" includes a failed state)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def is_broken(self) -> bool:
        """It refused a token: it can check nothing more."""
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    @property
    def failure(self) -> str:
        """Why it failed, in a line a client can read (llguidance's first line, without its parser's state)."""
        return _short(self.error)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmasks(
    states: list[GrammarState], vocab_size: int, drafts: list[list[int]] | None = None
) -> torch.Tensor:
    """[sum(len(d) + 1), ceil(V / 32)] int32: bit j % 32 of word j // 32 set = token j allowed. Each state fills
    one row, or with drafts one row after each prefix of its drafts (the rows of a verified decode)."""
    drafts = drafts or [[] for _ in states]
    bitmask = torch.empty(sum(len(d) + 1 for d in drafts), bitmask_words(vocab_size), dtype=torch.int32)
    row = 0
    for state, d in zip(states, drafts, strict=True):
        state.masks_along(d, bitmask[row : row + len(d) + 1])
        row += len(d) + 1
    return bitmask


class GrammarCompiler:
    """Compiles GrammarSpecs against one tokenizer, with a cache; safe to call from any thread."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        limits: llguidance.LLParserLimits | None = None,
    ):
        self._limits = limits  # llguidance's (None: its defaults); tests make them tight
        self._source = tokenizer  # read at the first grammar: a server that never gets one pays nothing
        self._vocab_size = vocab_size  # the model's: the bitmask covers every logit, even padding ids
        self._eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # made at the first grammar (~0.2-0.5 s)
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._checked: OrderedDict[GrammarSpec, str] = OrderedDict()  # check()'s answers: "" or the error
        self._lock = threading.Lock()

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        """The spec's compiled grammar if it is in the cache (cheap: no compile ever runs here)."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        return None

    def check(self, spec: GrammarSpec) -> None:
        """Raise ValueError as compile() would for a spec that does not build as a grammar, without compiling it
        against the vocabulary (~0.1 ms a typical schema, no tokenizer made): for a grammar that may never be
        used, such as the calls of tools a model may or may not make. Answers are cached by spec."""
        error = self.checked(spec)
        if error is None:
            try:
                error = _short(llguidance.LLMatcher.validate_grammar(grammar_text(spec)))
            except ValueError as e:
                error = str(e) or "not a grammar"
            with self._lock:
                self._checked[spec] = error
                while len(self._checked) > CACHE_SIZE:
                    self._checked.popitem(last=False)
        if error:
            raise ValueError(error)

    def checked(self, spec: GrammarSpec) -> str | None:
        """check()'s answer if it is known (cheap): "" when the spec builds, else why not; None if unknown."""
        with self._lock:
            if spec in self._cache:
                return ""
            if spec in self._checked:
                self._checked.move_to_end(spec)
                return self._checked[spec]
        return None

    def compile(self, spec: GrammarSpec, deadline: float | None = None) -> CompiledGrammar:
        """Raise ValueError with the grammar library's message when the spec is not a usable grammar.
        `deadline` (time.monotonic()) is when nobody waits for it any more: a GBNF conversion still running
        then is stopped, so that a refused request's compile lets go of its thread."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._source.to_json(), n_vocab=self._vocab_size, eos_token=self._eos_token_ids
                )
            tokenizer = self._tokenizer
        # Outside the lock: a large grammar takes a while, and llguidance lets go of the GIL meanwhile.
        gbnf_seconds = GBNF_SECONDS if deadline is None else min(GBNF_SECONDS, deadline - time.monotonic())
        text = grammar_text(spec, gbnf_seconds)
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=self._limits)
        # a grammar that did not build, or whose first mask fails (over the per-token budget, or no token may
        # start it), leaves the matcher failed
        first = fill_bitmasks([GrammarState(matcher)], self._vocab_size)
        if matcher.is_error():
            why = _short(matcher.get_error())
            raise ValueError(MATCHES_NOTHING if why == NOTHING_NEXT else why)
        if not matcher.is_accepting() and not first.any():
            raise ValueError(MATCHES_NOTHING)
        for warning in matcher.get_grammar_warnings():  # a lenient schema's keywords left unenforced
            log.warning("grammar: %s", _short(warning))
        compiled = CompiledGrammar(spec, matcher)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def is_quick(spec: GrammarSpec) -> bool:
    """Whether a spec compiles in milliseconds whatever it asks for: small, and not GBNF (whose conversion starts
    a child process, ~0.1 s each). Measured (2 cores): a one-property schema 2 ms; the slowest small hostile spec
    found, the regex a{100000}, 0.2 s; but a 1,000-rule GBNF chain (18 KB) 0.9 s, a 5,000-way anyOf (330 KB) 2.8 s."""
    if len(spec.source) > QUICK_BYTES:
        return False
    return spec.kind != "grammar" or is_lark_syntax(spec.source)


def grammar_text(spec: GrammarSpec, gbnf_seconds: float = GBNF_SECONDS) -> str:
    """The llguidance grammar for a spec (ValueError when the source cannot be read as its kind); a GBNF
    grammar's conversion may take gbnf_seconds."""
    try:
        if spec.kind == "json_schema":
            schema = json.loads(spec.source)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be a JSON object")
            check_depth(json_depth(schema))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_layout(spec.lenient))
        if spec.kind == "regex":
            # \d and \w as JSON Schema and JavaScript read them ([0-9], [0-9a-zA-Z_]): Rust's Unicode classes
            # let a model write a "digit" from any script (it did: U+1FBF8, SEGMENTED DIGIT EIGHT)
            return llguidance.LLMatcher.grammar_from_lark(
                f"start: /{llguidance.regex_to_lark(spec.source, 'dw')}/"
            )
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")
            return llguidance.grammar_from("choice", choices)
        if spec.kind == "grammar":  # GBNF (llama.cpp's) or Lark (llguidance's)
            lark = spec.source if is_lark_syntax(spec.source) else gbnf_to_lark(spec.source, gbnf_seconds)
            check_depth(lark_depth(lark))
            return llguidance.LLMatcher.grammar_from_lark(lark)
        if spec.kind == "tool_calls":
            lark = tool_calls_lark(json.loads(spec.source), spec.lenient)
            check_depth(lark_depth(lark))  # the schemas' $ref chains, in its %json blocks
            return llguidance.LLMatcher.grammar_from_lark(lark)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as e:
        raise ValueError(_short(str(e))) from None
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


def check_depth(depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(
            f"the grammar nests too deeply: over {MAX_DEPTH} levels of rules, groups and references"
        )


def lark_depth(lark: str, limit: int | None = MAX_DEPTH) -> int:
    """How deep llguidance's compiler recurses for a Lark grammar, in levels: a definition (rule or terminal)
    is its deepest group nesting + 1 + the depth of the deepest definition or %json block it names. Each
    definition is built once (a name met again is not followed again), and a name that refers back to one
    being built adds nothing: recursive grammars are normal. Strings, regexes, comments and special tokens hold
    no structure (llguidance bounds their nesting). Past `limit` it stops with a depth over it. Without
    recursion, and near-linear: a 4 MB grammar takes 0.2-0.7 s on 2 busy cores (as deep as may be: ~0.4 s)."""
    blocks: list[int] = []  # the depth of each %json block, which the Lark then names @i
    if "%json" in lark:
        pieces = []
        end = 0  # where the Lark not yet copied starts
        decoder = json.JSONDecoder()
        for lexeme in _LARK_OPAQUE.finditer(lark):  # inside a JSON value only its strings are lexemes
            if lexeme.start() < end or not lexeme.group().startswith("%json"):
                continue
            try:
                schema, json_end = decoder.raw_decode(lark, lexeme.end())
            except (ValueError, RecursionError):
                continue  # llguidance will refuse it
            pieces += [lark[end : lexeme.start()], f" @{len(blocks)} "]
            blocks.append(json_depth(schema, limit))
            end = json_end
        lark = "".join(pieces) + lark[end:]
    # [text before the first head, name, body, name, body, ...]; a directive's name is None
    parts = _LARK_HEAD.split(_LARK_OPAQUE.sub(" ", lark))
    names = parts[1::2]
    bodies = dict(zip(names, parts[2::2], strict=True))
    if len(bodies) < len(names):  # a name defined twice (llguidance refuses it): measure both as one
        bodies = {}
        for name, body in zip(names, parts[2::2], strict=True):
            bodies[name] = bodies.get(name, "") + "\n" + body
    bodies.pop(None, None)
    # Leaves (naming nothing) are found in C; Python parses the others only as the walk reaches them, so a deep
    # grammar is refused once the walk is past the limit, whatever its size
    keys, texts = list(bodies), list(bodies.values())
    grouped = set(compress(keys, map(_BRACKET.search, texts)))
    depth = dict.fromkeys(compress(keys, map(operator.not_, map(_NAMING.search, texts))), 1)
    for name in grouped & depth.keys():
        depth[name] += _group_depth(bodies[name])
    own: dict[str, tuple[int, int]] = {}  # once parsed: each definition's group nesting, deepest %json block

    def edges(name: str) -> list[str]:
        named = dict.fromkeys(_LARK_NAME.findall(bodies[name]))  # in order: the walk is the same each time
        blocks_below = [blocks[int(n[1:])] for n in named if n[0] == "@"]
        own[name] = (_group_depth(bodies[name]) if name in grouped else 0, max(blocks_below, default=0))
        return [n for n in named if n in bodies]

    def depth_of(name: str, below: int) -> int:
        groups, json_below = own[name]
        return groups + 1 + max(below, json_below)

    # llguidance builds from start; what it does not reach is measured too, from itself
    roots = ["start", *keys] if "start" in bodies else keys
    return _deepest(roots, edges, depth_of, limit, depth)


def _group_depth(body: str) -> int:
    """How deeply groups ((), [], {}) nest in a Lark body: the most open at once (for a long body in torch: 4 MB
    of them take ~0.05 s)."""
    brackets = _NOT_BRACKET.sub("", body).translate(_BRACKET_KIND)
    if len(brackets) > 256:
        opens = torch.frombuffer(bytearray(brackets.encode()), dtype=torch.uint8) == ord("(")
        return max(int((opens.int() * 2 - 1).cumsum(0).max()), 0)
    return max(accumulate((1 if b == "(" else -1 for b in brackets), initial=0))


def json_depth(schema, limit: int | None = MAX_DEPTH) -> int:
    """How deep llguidance's compiler recurses for a JSON schema, in levels: a container (object or array) is
    1 + the depth of the deepest container in it or that its $ref names. Each container is built once, and a
    $ref back to one being built adds nothing (recursive schemas are normal). $refs resolve as JSON Schema
    resolves them and llguidance does: JSON pointers, $id and $anchor, relative to the enclosing $id. Past
    `limit` it stops with a depth over it. Without recursion: the schema may be as deep as json.loads allows."""
    if not isinstance(schema, dict | list):
        return 0
    found: dict[str, object] = {}  # absolute URI (with #anchor) -> what it identifies
    refs: dict[int, str] = {}  # id of each object holding a $ref -> the absolute URI it names
    children: dict[int, list] = {}
    stack = [(schema, "")]
    while stack:
        value, base = stack.pop()
        if id(value) in children:
            continue
        if isinstance(value, dict):
            if isinstance(value.get("$id"), str):
                base = urllib.parse.urldefrag(urllib.parse.urljoin(base, value["$id"])).url
                found[base] = value
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(value.get(key), str):
                    found[f"{base}#{value[key]}"] = value
            if isinstance(value.get("$ref"), str):
                # most are "#/$defs/a" with no $id about: urljoin is slow for 100,000 of them
                ref = value["$ref"]
                refs[id(value)] = ref if not base and ref.startswith("#") else urllib.parse.urljoin(base, ref)
        children[id(value)] = [
            c for c in (value.values() if isinstance(value, dict) else value) if isinstance(c, dict | list)
        ]
        stack.extend((c, base) for c in children[id(value)])
    found.setdefault("", schema)

    def edges(key: int) -> list[int]:
        below = children[key]
        target = _resolve(found, refs[key]) if key in refs else None
        if isinstance(target, dict | list) and id(target) in children:
            below = [*below, target]
        return [id(c) for c in below]

    return _deepest([id(schema)], edges, lambda key, below: 1 + below, limit)


def _resolve(found: dict, uri: str):
    """What an absolute $ref URI names: a resource ($id) or anchor, or a JSON pointer into a resource; or None."""
    if uri in found:
        return found[uri]
    resource, pointer = urllib.parse.urldefrag(uri)
    target = found.get(resource)
    if target is None or not pointer.startswith("/"):
        return None
    for part in pointer[1:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def _deepest(roots: list, edges, depth_of, limit: int | None, depth: dict | None = None) -> int:
    """The greatest depth over a graph, by a depth-first walk from each root in turn with an explicit stack: a
    node's depth is depth_of(node, deepest of the nodes edges(node) names), each node is measured once (the
    first time it is met), and an edge back to a node still being measured counts 0, as a compiler that builds
    each definition once and refers back to one in progress recurses no further. Once a path from a root holds
    more than `limit` nodes (each at least a level deeper than the next), or a node measures more than `limit`,
    that is returned. `depth` may hold nodes already measured (leaves)."""
    depth = {} if depth is None else depth
    for root in roots:
        if root in depth:
            continue
        on_path = {root}
        below = edges(root)
        stack = [(root, below, iter(below))]
        while stack:
            node, below, pending = stack[-1]
            for child in pending:
                if child not in depth and child not in on_path:
                    child_below = edges(child)
                    if not child_below:  # a leaf: measured at once
                        depth[child] = depth_of(child, 0)
                        continue
                    on_path.add(child)
                    stack.append((child, child_below, iter(child_below)))
                    break
            else:
                stack.pop()
                on_path.discard(node)
                depth[node] = depth_of(node, max(map(depth.get, below, repeat(0, len(below))), default=0))
                if limit is not None and depth[node] > limit:
                    return depth[node]
                continue
            if limit is not None and len(stack) > limit:
                return len(stack)
    return max(depth.values(), default=0)


def tool_calls_lark(calls: dict, lenient: bool = False) -> str:
    """The Lark grammar of a reply made of tool calls (GrammarSpec kind tool_calls): each call a JSON value
    matching one of the schemas, between the open and close markers; one call, or several joined by the
    separator; or else, when or_json is given, JSON matching that schema."""
    schemas = calls["calls"]
    body = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
    literal = json.dumps  # a JSON string is a Lark string literal
    rules = [
        f"call: {literal(calls['open'])} {json_rule(body, lenient)} {literal(calls['close'])}",
        f"calls: call ({literal(calls['separator'])} call)*" if calls["many"] else "calls: call",
    ]
    start = (
        "start: calls"
        if calls.get("or_json") is None
        else f"start: {json_rule(calls['or_json'], lenient)} | calls"
    )
    return "\n".join([start, *rules]) + "\n"


def json_layout(lenient: bool) -> dict:
    """llguidance's options for a JSON schema: the layout constrained JSON always takes, and whether keywords it
    cannot enforce are ignored (lenient) or make the compile fail."""
    return {**JSON_LAYOUT, "lenient": lenient}


def json_rule(schema: dict, lenient: bool = False) -> str:
    """A Lark expression for JSON matching `schema`, in the layout constrained JSON always takes."""
    return "%json " + json.dumps({**schema, "x-guidance": json_layout(lenient)})


def gbnf_to_lark(source: str, seconds: float = GBNF_SECONDS) -> str:
    """A GBNF grammar in Lark, converted by llguidance in a child process that may run `seconds`. The converter
    is Python, holds the GIL, and takes time quadratic in how deeply rules chain (a chain of 3,000 rules took
    20 s): in this process it would stall every other request's tokens while it ran, and nothing could stop it
    (a shutdown waited on it). A child costs ~0.1 s per new grammar (compiled grammars are cached)."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _GBNF_TO_LARK],
            input=source.encode(),
            capture_output=True,
            timeout=max(seconds, 0.0),
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"the GBNF grammar took more than {max(seconds, 0.0):.2g} s to convert (too many rules chained)"
        ) from None
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip() or f"the converter exited with {done.returncode}"
        raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {why}")
    return done.stdout.decode()


NOTHING_NEXT = "the grammar allows no token here (no text matches it from this point)"
# NOTHING_NEXT before the first token, as a compile says it
MATCHES_NOTHING = (
    "the grammar matches no text: no token can start it (a $ref cycle, or a rule that starts with itself?)"
)
GRAMMAR_LINE = re.compile(r"\s*\d+ \| ")


def _short(message: str) -> str:
    # llguidance's messages can quote the whole grammar with a caret line ("N | text" lines: for a tool call,
    # kvserve's own grammar around the client's schema), or dump its parser's state after a "<state>" line; the
    # first other lines say what is wrong.
    lines = message.strip().split("\n<state>")[0].splitlines()
    lines = [line for line in lines if line.strip() and not GRAMMAR_LINE.match(line)][:3]
    if lines and lines[0].strip() == "NoExtensionBias":  # its word for: no token may come next
        return NOTHING_NEXT
    return " ".join(line.strip() for line in lines)[:300]
