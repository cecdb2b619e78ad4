"""N-gram drafts (drafting.py) without a model: what is proposed, how a request adapts, what a grammar allows."""

from server.engine.config import SpeculativeConfig
from server.engine.drafting import Drafter, accepted_drafts
from server.engine.request import SamplingParams
from server.engine.request_state import Request, RequestStatus
from server.engine.scheduler import ScheduledChunk


def decoding(prompt: list[int], output: list[int] = (), request_id: str = "r", **params) -> Request:
    r = Request(request_id, list(prompt), SamplingParams(**{"max_tokens": 100, **params}))
    r.output_token_ids = list(output)
    r.num_computed_tokens = r.num_tokens - 1  # its last token is next to compute
    r.status = RequestStatus.RUNNING
    return r


def propose(drafter: Drafter, request: Request) -> list[int]:
    drafter.after_step([], {}, {}, [request])
    return request.draft_token_ids


def test_the_tokens_after_the_latest_match_of_the_longest_suffix():
    d = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3))
    # suffix (5, 6, 7) occurred once, followed by 8 9 10; the shorter (6, 7) also at the end of the prompt
    r = decoding([5, 6, 7, 8, 9, 10, 11, 1, 6, 7, 42, 5, 6, 7])
    assert propose(d, r) == [8, 9, 10]
    # the latest occurrence wins, and drafts that reach the last token repeat the run since the occurrence
    r = decoding([1, 2, 3, 1, 2, 4, 1, 2])
    assert propose(Drafter(SpeculativeConfig(prompt_lookup_min=2)), r) == [4, 1, 2, 4]
    r = decoding([7, 1, 0, 0, 0, 0])  # a run of zeros: its suffix (0, 0) occurred one token back
    assert propose(Drafter(SpeculativeConfig(prompt_lookup_min=2)), r) == [0, 0, 0, 0]
    assert propose(Drafter(SpeculativeConfig()), decoding([1, 2, 3, 4, 5])) == []  # nothing repeats
    assert propose(Drafter(SpeculativeConfig()), decoding([1, 2, 1, 2], speculative=False)) == []


def test_the_index_grows_with_the_output():
    d = Drafter(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2))
    r = decoding([1, 2, 3, 4, 9, 9])
    assert propose(d, r) == []
    r.output_token_ids += [1, 2]  # now the suffix (1, 2) is the prompt's start
    r.num_computed_tokens = r.num_tokens - 1
    assert propose(d, r) == [3, 4]


def test_drafts_stop_at_max_tokens_and_in_large_batches():
    d = Drafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    r = decoding([1, 2, 3, 4, 5, 6], [1], max_tokens=3)
    assert propose(d, r) == [2]  # the output may grow by 2: one draft and the draw after it
    crowd = [decoding([1, 2, 3, 1, 2], request_id=f"r{i}") for i in range(3)]
    small = Drafter(SpeculativeConfig(prompt_lookup_min=2, max_step_rows=3))
    small.after_step([], {}, {}, crowd)
    assert all(r.draft_token_ids == [] for r in crowd)  # three decodes fill the step's rows
    prefilling = decoding([1, 2, 3, 1, 2])
    prefilling.num_computed_tokens = 2
    assert propose(Drafter(SpeculativeConfig(prompt_lookup_min=2)), prefilling) == []


def test_a_request_drafts_what_its_acceptance_pays_for_and_backs_off_after_misses():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2)
    d = Drafter(config)
    r = decoding([1, 2, 3, 4, 5, 6, 1, 2])
    # nothing timed: a step of n rows costs 1 + 0.15 (n - 1) one-row steps. Nothing known of r yet (a = 0.8):
    # 1 + 0.8 + ... + 0.8^4 = 3.36 tokens in 1.6 steps beats every shorter run
    assert propose(d, r) == [3, 4, 5, 6]

    def verify(drafts, kept):
        chunk = ScheduledChunk(r, r.num_computed_tokens, 1 + len(drafts), True, False, drafts)
        d.after_step([chunk], {"r": kept}, {}, [r])

    # one kept of four: a = (0.8 * 2 + 1) / (2.6 + 0.8 * 0.5 + 1) = 0.65; 3 drafts make 2.35 tokens in 1.45
    # steps (1.62 a step), 4 make 2.53 in 1.6 (1.58)
    verify([3, 4, 5, 6], [3, 9])
    assert r.draft_token_ids == [3, 4, 5] and d.num_accepted_tokens == 1
    verify([3, 4, 5], [8])  # none kept: a = 2.08 / 4.2 = 0.495; wait a step, then try
    assert r.draft_token_ids == []
    d.after_step([], {}, {}, [r])
    # the trial's one, counted as sure (2 tokens in 1.15 steps); a second (0.495^2) would make 2.245 in 1.3
    assert r.draft_token_ids == [3]
    verify([3], [8])  # none again: a = 1.66 / 4.36 = 0.38, after a wait of two steps: the trial's one
    assert r.draft_token_ids == [] and [propose(d, r) for _ in range(2)] == [[], [3]]
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens) == (3, 8, 1)
    assert dict(d.accepted_per_position) == {0: 1}


def test_the_drafts_a_step_verifies_follow_what_its_steps_cost_on_this_host():
    def drafts_at(costs: dict[int, float]) -> list[int]:
        """What a new request (a = 0.8) drafts once a decode with each number of drafts in `costs` was timed."""
        d = Drafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2))
        for drafts, seconds in costs.items():
            for _ in range(3):
                d.costs.record(1, drafts, seconds)
        return propose(d, decoding([1, 2, 3, 4, 5, 6, 1, 2]))

    # rows nearly free (a bandwidth-bound step): all four
    assert drafts_at({0: 5.0, 1: 5.2, 2: 5.4, 3: 5.6, 4: 5.8}) == [3, 4, 5, 6]
    # this AVX2 host's (Zen 3, the default model, ms): a = 0.8 makes 2.44 tokens in 7.68 ms with two drafts,
    # the most a millisecond (three: 2.95 in 9.86; four: 3.36 in 14.71)
    assert drafts_at({0: 4.89, 1: 6.88, 2: 7.68, 3: 9.86, 4: 14.71}) == [3, 4]
    # rows as dear as a step: none, and the request waits before it tries again
    assert drafts_at({k: 5.0 * (k + 1) for k in range(5)}) == []
    # steps not timed take the nearest timed one's seconds, grown or shrunk by 0.15 of a one-row step a row
    assert drafts_at({4: 1.6}) == [3, 4, 5, 6]  # the same as nothing timed


class Forcing:
    """A grammar whose next tokens are forced (a JSON key)."""

    def forced_tokens(self) -> list[int]:
        return [7, 8, 9]


def test_sure_drafts_go_in_where_a_sure_token_pays_for_its_row():
    def forced_at(costs: dict[int, float]) -> list[int]:
        d = Drafter(SpeculativeConfig(prompt_lookup_min=2))
        for drafts, seconds in costs.items():
            for _ in range(3):
                d.costs.record(1, drafts, seconds)
        r = decoding([1, 2, 3])
        r.grammar = Forcing()
        return propose(d, r)

    assert forced_at({}) == [7, 8, 9]
    assert forced_at({0: 4.89, 1: 6.88, 2: 7.68, 3: 9.86}) == [7, 8, 9]
    assert forced_at({0: 5.0, 1: 10.5, 2: 16.0, 3: 21.5}) == []  # a row costs more than the step's token

    # after a wait, a request tries its first draft (counted as sure) only where a sure draft would pay
    d = Drafter(SpeculativeConfig(prompt_lookup_min=2, max_step_rows=8))
    for drafts in range(5):  # four decodes in 12.9 ms, and 3.9 ms a draft more: a token costs 3.2 ms without
        for _ in range(3):
            d.costs.record(4, drafts, 12.9 + 3.9 * drafts)
    crowd = [decoding([1, 2, 3, 1, 2], request_id=f"r{i}") for i in range(4)]
    for _ in range(8):
        d.after_step([], {}, {}, crowd)
        assert all(c.draft_token_ids == [] for c in crowd)  # a sure draft: 5 tokens in 16.8 ms
    assert all(d._states[c.request_id].backoff == 8 for c in crowd)  # and each waits longer, 1, 2, 4 steps


def test_step_costs_are_medians_of_decode_only_steps():
    d = Drafter(SpeculativeConfig(prompt_lookup_min=2))
    r = decoding([1, 2, 3, 4, 5, 6, 1, 2])
    prefill = decoding([7, 8, 9, 10], request_id="p")
    prefill.num_computed_tokens = 0
    decode = ScheduledChunk(r, r.num_computed_tokens, 1, True, False, [])
    verify = ScheduledChunk(r, r.num_computed_tokens, 3, True, False, [3, 4])
    for seconds in (0.010, 0.011, 0.500):  # one slow step (a collection) among three
        d.after_step([decode], {"r": [5]}, {}, [r], seconds)
        d.after_step([verify], {"r": [3, 4, 5]}, {}, [r], seconds + 0.004)
        # a step with a prefill chunk times prefill, not decodes: not recorded
        d.after_step([decode, ScheduledChunk(prefill, 0, 4, False, False, [])], {"r": [5]}, {}, [r], 9.0)
    assert d.costs.timed(1, 0) == 0.011 and d.costs.timed(1, 2) == 0.015 and d.costs.timed(2, 0) is None
    for _ in range(2):
        d.costs.record(2, 1, 0.020)
    assert d.costs.timed(2, 1) is None  # two are not enough
    # untimed: the nearest timed step of as many decodes (the fewer drafts first), 0.15 of a row-step a row
    assert d.costs.seconds(1, 7)[1] == 0.011 * 1.15 and d.costs.seconds(1, 7)[3] == 0.015 / 1.3 * 1.45
    assert d.costs.seconds(2, 6)[1] == 1.3  # none of two decodes timed: in units of a one-row step
    d.costs.record(2, 1, 0.020)
    assert d.costs.seconds(2, 6)[1] == 0.020 and d.costs.seconds(2, 6)[0] == 0.020 / 1.3 * 1.15


def test_a_request_whose_drafts_do_not_pay_waits_then_tries_one():
    d = Drafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2))
    r = decoding([1, 2, 3, 4, 5, 6, 1, 2])
    propose(d, r)
    for _ in range(6):  # six misses, each after its wait: a = 0.52 / (0.52 + 0.13 + 3.69) = 0.12
        chunk = ScheduledChunk(
            r, r.num_computed_tokens, 1 + len(r.draft_token_ids), True, False, r.draft_token_ids
        )
        d.after_step([chunk], {"r": [9]}, {}, [r])
        while not r.draft_token_ids:
            d.after_step([], {}, {}, [r])
        assert d._states["r"].backoff == 2**d.num_drafts  # each miss doubles the next wait
    # a trial: its first draft, counted as sure (2 tokens in 1.15 steps); a second (0.12^2) does not pay
    assert r.draft_token_ids == [3]
    # eight decodes fill the step's eight rows: none drafts, not even a new request
    crowd = [decoding([1, 2, 3, 1, 2], request_id=f"r{i}") for i in range(8)]
    d.after_step([], {}, {}, crowd)
    assert all(c.draft_token_ids == [] for c in crowd)


def test_accepted_drafts_is_the_common_prefix():
    assert accepted_drafts([1, 2, 3], [1, 2, 9]) == 2
    assert accepted_drafts([1, 2], [1, 2, 5]) == 2
    assert accepted_drafts([1, 2], [7]) == 0
    assert accepted_drafts([1, 2, 3], [1]) == 1  # the output ended at the first


def test_a_step_shares_its_rows_most_likely_drafts_first():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, max_step_rows=7)
    d = Drafter(config)
    a, b, c = (decoding([1, 2, 3, 4, 5, 6, 1, 2], request_id=x) for x in "abc")
    # 3 decodes and 4 rows left: the first draft of each (0.8), then a's second (0.64): 6.04 tokens in 1.9 steps
    d.after_step([], {}, {}, [a, b, c])
    assert (a.draft_token_ids, b.draft_token_ids, c.draft_token_ids) == ([3, 4], [3], [3])

    def verify(r):
        drafts = r.draft_token_ids
        return ScheduledChunk(r, r.num_computed_tokens, 1 + len(drafts), True, False, drafts)

    # a keeps none (it waits a step): b and c (0.8) share the rows, two each
    d.after_step([verify(a), verify(b), verify(c)], {"a": [9], "b": [3, 5], "c": [3, 5]}, {}, [a, b, c])
    assert (a.draft_token_ids, b.draft_token_ids, c.draft_token_ids) == ([], [3, 4], [3, 4])
    # b keeps both, c none: b's drafts are the likelier, and a, back from its wait, tries one
    d.after_step([verify(b), verify(c)], {"b": [3, 4, 5], "c": [9]}, {}, [a, b, c])
    assert (a.draft_token_ids, b.draft_token_ids, c.draft_token_ids) == ([3], [3, 4, 5], [])
