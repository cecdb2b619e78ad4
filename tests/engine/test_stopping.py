"""The stop rules, asked of a request's output as it stands (stopping.py): bans before the draw, finishes after."""

from server.engine.request import FinishReason, SamplingParams
from server.engine.request_state import Request
from server.engine.stopping import banned_token_ids, finish_reason

EOS, STOP_ID, OTHER = 2, 7, 50


def request(prompt_len: int = 4, **params) -> Request:
    return Request("r", list(range(10, 10 + prompt_len)), SamplingParams(**params), frozenset({EOS}))


class FakeGrammar:
    def __init__(self, complete: bool = False):
        self.is_complete = complete


def test_stop_tokens_are_banned_until_min_tokens_exist():
    r = request(max_tokens=8, min_tokens=3, stop_token_ids=[STOP_ID])
    assert banned_token_ids(r, 0) == banned_token_ids(r, 2) == [EOS, STOP_ID]
    assert banned_token_ids(r, 3) == []
    assert banned_token_ids(request(max_tokens=8, min_tokens=3, ignore_eos=True), 0) == []
    r.grammar = FakeGrammar()  # the grammar says where the output may end
    assert banned_token_ids(r, 0) == []


def test_a_token_ends_the_output_by_stop_token_then_length():
    r = request(max_tokens=4, min_tokens=2, stop_token_ids=[STOP_ID])
    assert finish_reason(r, OTHER, 1, 100) is None
    assert finish_reason(r, EOS, 1, 100) is None  # before min_tokens a stop token is only text
    assert finish_reason(r, EOS, 2, 100) is FinishReason.STOP
    assert finish_reason(r, STOP_ID, 3, 100) is FinishReason.STOP
    assert finish_reason(r, OTHER, 4, 100) is FinishReason.LENGTH
    assert finish_reason(r, EOS, 4, 100) is FinishReason.STOP  # a stop token wins over the length it reaches
    assert finish_reason(request(max_tokens=8, ignore_eos=True), EOS, 1, 100) is None
    # the context: prompt (4) + output reaching max_model_len
    assert finish_reason(request(max_tokens=100), OTHER, 5, 10) is None
    assert finish_reason(request(max_tokens=100), OTHER, 6, 10) is FinishReason.LENGTH


def test_a_complete_grammar_ends_the_output():
    r = request(max_tokens=4)
    r.grammar = FakeGrammar()
    assert finish_reason(r, OTHER, 1, 100) is None
    r.grammar = FakeGrammar(complete=True)
    assert finish_reason(r, OTHER, 4, 100) is FinishReason.STOP  # whole, though the length was reached too
