"""A thinking model's reasoning in the engine (SamplingParams.reasoning, marker_token_ids), on tiny models whose
greedy replies are scripted by their weights (tests/helpers/thinking_models.py): the grammar constrains the
answer only, the budget closes the reasoning, and the marker tokens leave the text with their places marked."""

import json

import pytest

from server.engine.config import EngineConfig, SpeculativeConfig
from server.engine.engine import Engine
from server.engine.request import FinishReason, GrammarSpec, ParamError, ReasoningSpec, SamplingParams
from tests.helpers import thinking_models as tm
from tests.helpers.engine_runs import assert_all_blocks_free, run

pytestmark = pytest.mark.timeout(120)
# bounded: the model's own choice between the digits the grammar allows could go on for ever
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": [3, 4, 5]}},
    "required": ["answer"],
    "additionalProperties": False,
}
# steps read back one by one; with n-gram drafts; under async scheduling (each launched before the one before is
# read: a request whose draws its reasoning steers is read back first)
MODES = {
    "plain": {},
    "speculative": {"speculative": SpeculativeConfig()},
    "async": {"async_scheduling": True},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking")
    return {
        "think": tm.think_model(root / "think"),
        "open": tm.think_model(root / "open", tm.OPEN_THINK_TEMPLATE),
        "loop": tm.think_model(root / "loop", script=tm.LOOP_SCRIPT),
        "harmony": tm.harmony_model(root / "harmony"),
    }


def engine(path, **config) -> Engine:
    return Engine(str(path), EngineConfig(kv_cache_memory=8 << 20, block_size=4, **config))


def prompt(e: Engine, **kwargs) -> list[int]:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    return e.tokenizer.encode(e.tokenizer.apply_chat_template(messages, True, None, kwargs))


def ids(e: Engine, *texts: str) -> list[int]:
    return [t for text in texts for t in e.tokenizer.encode(text)]


def think_spec(e: Engine, opens: bool, budget: int | None = None) -> ReasoningSpec:
    close = e.tokenizer.encode("</think>")[0]
    return ReasoningSpec((close,), e.tokenizer.encode("<think>")[0] if opens else None, budget, (close,))


def markers(e: Engine) -> frozenset[int]:
    return frozenset(ids(e, "<think>", "</think>"))


def decode(e: Engine, token_ids: list[int]) -> str:
    return e.tokenizer.decode(token_ids, skip_special_tokens=False)


def test_the_scripted_model_thinks_then_answers(models):
    """What the tests below build on: the reply, free."""
    e = engine(models["think"])
    (tokens, _, reason) = run(e, {"a": prompt(e)}, SamplingParams(max_tokens=40, temperature=0))["a"]
    assert decode(e, tokens) == "<think>Sum: 4</think>OK<|im_end|>" and reason is FinishReason.STOP


@pytest.mark.parametrize("mode", MODES)
def test_the_grammar_constrains_the_answer_not_the_reasoning(models, mode):
    e = engine(models["think"], **MODES[mode])
    grammar = e.grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    free = SamplingParams(max_tokens=40, temperature=0, grammar=grammar)
    after = SamplingParams(
        max_tokens=40,
        temperature=0,
        grammar=grammar,
        reasoning=think_spec(e, True),
        marker_token_ids=markers(e),
    )
    result = run(e, {"free": prompt(e), "after": prompt(e)}, {"free": free, "after": after})
    # from the first token, the grammar forbids the reasoning
    tokens, text, reason = result["free"]
    assert "<think>" not in decode(e, tokens) and json.loads(text)["answer"] is not None
    # after it, the reasoning is the model's own, and the answer is JSON of the schema
    tokens, text, reason = result["after"]
    reply = decode(e, tokens)
    assert reply.startswith("<think>Sum: 4</think>{") and reason is FinishReason.STOP
    answer = json.loads(reply.removeprefix("<think>Sum: 4</think>"))
    assert set(answer) == {"answer"} and isinstance(answer["answer"], int)
    assert text == "Sum: 4" + json.dumps(answer)  # the markers are left out of the text
    assert_all_blocks_free(e)


def test_a_prompt_that_opened_the_reasoning_starts_the_output_in_it(models):
    e = engine(models["open"])
    grammar = e.grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    params = SamplingParams(
        max_tokens=40,
        temperature=0,
        grammar=grammar,
        reasoning=think_spec(e, False),
        marker_token_ids=markers(e),
    )
    tokens, text, _ = run(e, {"a": prompt(e)}, params)["a"]
    assert decode(e, tokens).startswith("Sum: 4</think>{") and json.loads(text.removeprefix("Sum: 4"))


def test_a_first_token_that_does_not_open_the_reasoning_starts_the_answer(models):
    """The template left the reasoning to the model (opens_with): its first token is the answer's, under the
    grammar, when it is not the opening."""
    e = engine(models["think"])
    # with enable_thinking false the model answers "OK" at once; the grammar allows that or the reasoning
    grammar = e.grammars.compile(GrammarSpec("regex", "OK|no"))
    params = SamplingParams(max_tokens=10, temperature=0, grammar=grammar, reasoning=think_spec(e, True))
    tokens, text, reason = run(e, {"a": prompt(e, enable_thinking=False)}, params)["a"]
    assert text == "OK" and reason is FinishReason.STOP


def test_marks_say_where_the_markers_fell(models):
    e = engine(models["think"])
    params = SamplingParams(max_tokens=40, temperature=0, marker_token_ids=markers(e))
    e.add_request("a", prompt(e), params)
    text, marks = "", []
    while e.has_work():
        for out in e.step():
            marks += [(len(text) + offset, token_id) for offset, token_id in out.marks]
            text += out.text
    assert text == "Sum: 4OK"
    assert marks == [(0, ids(e, "<think>")[0]), (6, ids(e, "</think>")[0])]


@pytest.mark.parametrize("mode", MODES)
def test_the_budget_closes_the_reasoning(models, mode):
    """The loop model thinks "abcabc..." until stopped: at its budget the close is forced, and the answer
    follows. Drafts (the loop repeats) never run past the budget."""
    e = engine(models["loop"], **MODES[mode])
    params = SamplingParams(max_tokens=60, temperature=0, reasoning=think_spec(e, True, budget=10))
    tokens, _, reason = run(e, {"a": prompt(e)}, params)["a"]
    assert decode(e, tokens) == "<think>abcabcabc</think>OK<|im_end|>" and reason is FinishReason.STOP
    unbounded = SamplingParams(max_tokens=30, temperature=0, reasoning=think_spec(e, True))
    tokens, _, reason = run(e, {"b": prompt(e)}, unbounded)["b"]
    assert "</think>" not in decode(e, tokens) and reason is FinishReason.LENGTH
    assert_all_blocks_free(e)


def test_harmony_grammar_starts_at_the_final_channel(models):
    e = engine(models["harmony"])
    tok = e.tokenizer
    answer = tuple(tok.encode("<|channel|>final<|message|>"))
    close = tuple(tok.encode("<|end|><|start|>assistant")) + answer
    grammar = e.grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    params = SamplingParams(
        max_tokens=40, temperature=0, grammar=grammar, reasoning=ReasoningSpec(answer, None, None, close)
    )
    tokens, _, reason = run(e, {"a": prompt(e)}, params)["a"]
    reply = decode(e, tokens)
    head = "<|channel|>analysis<|message|>Sum: 4<|end|><|start|>assistant<|channel|>final<|message|>"
    assert reply.startswith(head) and json.loads(reply.removeprefix(head))["answer"] is not None
    # a budget of 6 closes the analysis after "Sum" (the header's 3 tokens count): the close is forced whole
    params = SamplingParams(max_tokens=40, temperature=0, reasoning=ReasoningSpec(answer, None, 6, close))
    tokens, _, _ = run(e, {"b": prompt(e)}, params)["b"]
    forced = "<|channel|>analysis<|message|>Sum<|end|><|start|>assistant<|channel|>final<|message|>"
    assert decode(e, tokens).startswith(forced)


def test_a_bad_reasoning_spec_is_refused_by_name(models):
    e = engine(models["think"])
    close = e.tokenizer.encode("</think>")[0]
    for spec, why in [
        (ReasoningSpec((), None), "at least one token"),
        (ReasoningSpec((close,), None, 0, (close,)), "at least 1"),
        (ReasoningSpec((close,), None, 5, ()), "ends with"),
        (ReasoningSpec((10**6,), None), "token ids"),
    ]:
        with pytest.raises(ParamError, match=why) as raised:
            e.validate([1, 2], SamplingParams(reasoning=spec))
        assert raised.value.param == "reasoning"
