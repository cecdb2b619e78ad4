"""The tool-call machinery without a model: the streaming parser, the history rendering and the grammar."""

import itertools
import json

import pytest

from model.tokenizer import Tokenizer
from server.api.tools import Function, ToolCallParser, Tools, output_grammar, render_history
from server.engine.grammar import tool_calls_lark

pytestmark = pytest.mark.timeout(30)

TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Ville\\" {", "days": [1, {"a": 2}]}}\n'
    '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
)


def parse(text: str, step: int, cut: bool = False, **kw) -> tuple[str, list[dict], list]:
    """Feed `text` in pieces of `step` characters, the reply cut there by max_tokens if `cut`; (content, calls
    reassembled, every piece)."""
    ids = (f"call_{i}" for i in itertools.count())
    parser = ToolCallParser({"get_weather", "add"}, new_id=lambda: next(ids), **kw)
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    content, calls, deltas = "", [], []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        c, ds = parser.feed(piece, final=last, cut=cut and last)
        content += c
        deltas += ds
        for d in ds:
            if d.index == len(calls):
                assert d.id is not None and d.name is not None  # a call's id and name come in its first piece
                calls.append({"id": d.id, "name": d.name, "arguments": d.arguments})
            else:
                assert d.id is None and d.name is None
                calls[d.index]["arguments"] += d.arguments
    assert parser.num_calls == len([c for c in calls if _complete(c["arguments"])])
    return content, calls, deltas


def _complete(arguments: str) -> bool:
    try:
        json.loads(arguments)
        return True
    except json.JSONDecodeError:
        return False


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_calls_stream_whatever_the_pieces(step):
    content, calls, deltas = parse(TWO_CALLS, step)
    assert content == ""
    assert [c["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'Paris "Ville" {', "days": [1, {"a": 2}]}
    assert calls[1]["arguments"] == '{"a": 1}'
    assert deltas[0].arguments == ""  # the name goes out before any argument is written
    if step <= 3:  # arguments go out as they come, not at the end
        assert len([d for d in deltas if d.index == 0]) > 10


def test_text_without_calls_is_unchanged():
    for text in ["Hello there.\n\nHow are you?  \n", "a < b and <tool> is not <tool_call", " x <tool_c"]:
        for step in (1, 2, 5):
            content, calls, _ = parse(text, step)
            assert content == text and calls == []


def test_text_before_a_call_is_content_and_blank_space_around_calls_goes():
    content, calls, _ = parse(
        'Sure, let me check.\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n', 2
    )
    assert content == "Sure, let me check." and [c["name"] for c in calls] == ["add"]


def test_what_is_not_a_call_of_a_declared_function_stays_text():
    for text in [
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        "Look: <tool_call> is a tag </tool_call> ok",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}',  # cut before its end, with no name parsed
    ]:
        content, calls, _ = parse(text.replace('"add"', '"add_x"'), 3)
        assert calls == [] and content == text.replace('"add"', '"add_x"')


def test_a_call_written_arguments_first_is_read_whole():
    content, calls, _ = parse('<tool_call>\n{"arguments": {"a": 2}, "name": "add"}\n</tool_call>', 4)
    assert content == "" and calls[0]["name"] == "add" and json.loads(calls[0]["arguments"]) == {"a": 2}


def test_a_call_cut_short_keeps_its_partial_arguments():
    content, calls, _ = parse('<tool_call>\n{"name": "add", "arguments": {"a": "aaa', 3)
    assert content == "" and calls == [{"id": "call_0", "name": "add", "arguments": '{"a": "aaa'}]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_call_or_tag_cut_short_by_max_tokens_is_never_content(step):
    """Where max_tokens ends a reply inside a call's opening or its tag, what was written of it goes: the model's
    markup is not the reply's text. A call whose name is out keeps its partial arguments, and one whose name is
    cut short is a call of the one declared function that name can begin (its arguments not begun)."""
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for cut_at in range(1, whole.index("{", 20)):  # every cut before its arguments begin
        for before, text in (("", ""), ("Let me check.\n", "Let me check."), (whole + "\n", "")):
            content, calls, _ = parse(before + whole[:cut_at], step, cut=True)
            assert content == text, (before, whole[:cut_at], content)
            # once its name's first letter is out (of get_weather and add, only one) the call is there
            named = cut_at > whole.index("get_weather")
            assert len(calls) == before.count("<tool_call>") + named, (before, whole[:cut_at], calls)
    # where the model itself ended the reply, a partial tag is its text
    content, calls, _ = parse("Use x <tool_c", step)
    assert (content, calls) == ("Use x <tool_c", [])
    # a cut-short block naming no declared function stays as written
    rm = '<tool_call>\n{"name": "rm_rf", "argu'
    assert parse(rm, step, cut=True)[:2] == (rm, [])


def test_a_call_cut_before_its_name_is_the_only_function_it_can_be():
    """tool_choice naming a function (or one function offered), max_tokens ending the reply before its name:
    the reply is that function's call with its arguments not begun, finish_reason length, not an empty message."""
    for cut in ("<tool_call>", "<tool_call>\n", '<tool_call>\n{"', '<tool_call>\n{"name": "get_'):
        for names, expected in (({"get_weather"}, ["get_weather"]), ({"get_weather", "get_time"}, [])):
            parser = ToolCallParser(names, new_id=lambda: "call_0")
            content, deltas = parser.feed(cut, final=True, cut=True)
            assert content == "" and [d.name for d in deltas] == expected, (cut, names)
            assert all(d.arguments == "" for d in deltas)
    parser = ToolCallParser({"get_weather", "get_time"}, new_id=lambda: "call_0")
    assert [d.name for d in parser.feed('<tool_call>\n{"name": "get_t', final=True, cut=True)[1]] == [
        "get_time"
    ]


def test_one_call_when_not_parallel():
    content, calls, _ = parse(TWO_CALLS + "\nand some words", 5, parallel=False)
    assert [c["name"] for c in calls] == ["get_weather"] and content == ""


WEATHER = Function("get_weather", "Weather", {"type": "object", "properties": {"city": {"type": "string"}}})
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
]


def test_history_for_a_template_without_tools():
    out = render_history([dict(m) for m in HISTORY], Tools([WEATHER]), template_has_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert (
        out[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert (
        out[3]["content"]
        == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    )
    # tool_choice none: the history stays, the tools are not offered
    assert [
        m["role"] for m in render_history([dict(m) for m in HISTORY], Tools([WEATHER], "none"), False)
    ] == [
        "user",
        "assistant",
        "user",
    ]


def test_history_for_a_template_with_tools(tiny_llama_dir):
    template = (
        "{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% else %}{{ m.content }}{% endif %}"
        "{% endfor %}{% if tools %}{% for t in tools %}<{{ t.function.name }}>{% endfor %}{% endif %}"
    )
    tokenizer = Tokenizer.from_dir(tiny_llama_dir, chat_template=template)
    assert tokenizer.template_renders_tools and not Tokenizer.from_dir(tiny_llama_dir).template_renders_tools
    out = render_history([dict(m) for m in HISTORY], Tools([WEATHER]), template_has_tools=True)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }  # an object, as templates read
    text = tokenizer.apply_chat_template(
        out, add_generation_prompt=False, tools=Tools([WEATHER]).template_tools()
    )
    assert text == "[user]Weather in Paris?[assistant]get_weather(Paris)[tool]18 C[tool]sunny<get_weather>"


def test_the_grammars_of_each_tool_choice():
    def lark(tools: Tools, answer: dict | None) -> str:
        spec = output_grammar(tools, answer)
        assert spec.kind == "tool_calls"  # built into Lark by the engine's grammar module
        return tool_calls_lark(json.loads(spec.source))

    add = Function("add", None, {"type": "object"})
    assert output_grammar(None, None) is None
    assert output_grammar(Tools([WEATHER, add], "auto"), None) is None  # free text, calls parsed from it
    assert output_grammar(Tools([WEATHER], "none"), {"type": "object"}).kind == "json_schema"
    required = lark(Tools([WEATHER, add], "required"), None)
    assert "start: calls" in required and 'call ("\\n" call)*' in required and '"const": "add"' in required
    one = lark(Tools([WEATHER, add], "required", parallel=False), None)
    assert "calls: call\n" in one
    named = lark(Tools([WEATHER, add], "add"), None)
    assert '"const": "add"' in named and "get_weather" not in named and "calls: call\n" in named
    either = lark(Tools([WEATHER], "auto"), {"type": "object"})
    assert either.startswith("start: %json") and "| calls" in either


Q = '<|"|>'  # Gemma 4's string delimiter


@pytest.mark.parametrize(
    "body, expected",
    [
        (f"call:get_weather{{city:{Q}Paris{Q}}}", ("get_weather", {"city": "Paris"})),
        ("call:f{}", ("f", {})),
        # every kind of value, nested, with commas and braces inside strings
        (
            f"call:book{{when:{Q}a, b {{c}}{Q},n:42,x:-1.5e3,ok:true,no:false,none:null,"
            f"list:[{Q}a{Q},1,[2]],obj:{{k:{Q}v{Q},deep:{{z:0}}}}}}",
            (
                "book",
                {
                    "when": "a, b {c}",
                    "n": 42,
                    "x": -1500.0,
                    "ok": True,
                    "no": False,
                    "none": None,
                    "list": ["a", 1, [2]],
                    "obj": {"k": "v", "deep": {"z": 0}},
                },
            ),
        ),  # fmt: skip
        (f"call:f{{{Q}quoted key{Q}:1}}", ("f", {"quoted key": 1})),
        ("call:f{city:Paris}", ("f", {"city": "Paris"})),  # an unquoted word: the string meant
        # not calls: no head, arguments that do not close, a key without a value, text after the arguments
        ("get_weather{city:1}", (None, None)),
        (f"call:f{{city:{Q}Paris", ("f", None)),
        ("call:f{city:}", ("f", None)),
        ("call:f{a:1} and more", ("f", None)),
    ],
)
def test_gemma4s_call_syntax_reads_as_json_arguments(body, expected):
    from server.api.tools import gemma4_call

    assert gemma4_call(body) == expected
