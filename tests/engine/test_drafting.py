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
    assert propose(d, r) == [3, 4, 5, 6]  # nothing known yet: all of them

    def verify(drafts, kept):
        chunk = ScheduledChunk(r, r.num_computed_tokens, 1 + len(drafts), True, False, drafts)
        d.after_step([chunk], {"r": kept}, {}, [r])

    # one kept of four: a = (0.8 * 2 + 1) / (2.6 + 0.8 * 0.5 + 1) = 0.65, and 0.65^k > 0.15 (one decode) to k = 4
    verify([3, 4, 5, 6], [3, 9])
    assert r.draft_token_ids == [3, 4, 5, 6] and d.num_accepted_tokens == 1
    verify([3, 4, 5, 6], [8])  # none kept: a = 2.08 / 4.2 = 0.495 (k = 2); wait a step, then try
    assert r.draft_token_ids == []
    d.after_step([], {}, {}, [r])
    assert r.draft_token_ids == [3, 4]
    verify([3, 4], [8])  # none again: a = 1.66 / 4.36 = 0.38 (k = 1), after a wait of two steps
    assert r.draft_token_ids == [] and [propose(d, r) for _ in range(2)] == [[], [3]]
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens) == (3, 10, 1)
    assert dict(d.accepted_per_position) == {0: 1}


def test_a_request_whose_drafts_do_not_pay_waits_then_tries_one():
    d = Drafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2))
    r = decoding([1, 2, 3, 4, 5, 6, 1, 2])
    propose(d, r)
    for _ in range(6):  # six misses, each after its wait: a = 0.52 / (0.52 + 0.13 + 3.69) = 0.12, below 0.15
        chunk = ScheduledChunk(
            r, r.num_computed_tokens, 1 + len(r.draft_token_ids), True, False, r.draft_token_ids
        )
        d.after_step([chunk], {"r": [9]}, {}, [r])
        while not r.draft_token_ids:
            d.after_step([], {}, {}, [r])
        assert d.num_drafts < 6 or r.draft_token_ids == [3]  # a trial: one draft, where none would pay
    # at eight decodes a draft would have to be kept with a chance over 1.2: none drafts, not even a new request
    crowd = [decoding([1, 2, 3, 1, 2], request_id=f"r{i}") for i in range(8)]
    d.after_step([], {}, {}, crowd)
    assert all(c.draft_token_ids == [] for c in crowd)


def test_accepted_drafts_is_the_common_prefix():
    assert accepted_drafts([1, 2, 3], [1, 2, 9]) == 2
    assert accepted_drafts([1, 2], [1, 2, 5]) == 2
    assert accepted_drafts([1, 2], [7]) == 0
    assert accepted_drafts([1, 2, 3], [1]) == 1  # the output ended at the first


def test_a_step_shares_its_rows_best_acceptance_first():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, max_step_rows=7)
    d = Drafter(config)
    a, b, c = (decoding([1, 2, 3, 4, 5, 6, 1, 2], request_id=x) for x in "abc")
    # 3 decodes: a draft must be kept with a chance over 0.45, and 0.8^3 is; 4 rows left: a takes 3, b the last
    d.after_step([], {}, {}, [a, b, c])
    assert (a.draft_token_ids, b.draft_token_ids, c.draft_token_ids) == ([3, 4, 5], [3], [])

    def verify(r):
        drafts = r.draft_token_ids
        return ScheduledChunk(r, r.num_computed_tokens, 1 + len(drafts), True, False, drafts)

    # a keeps none (its estimate falls to 0.53, and it waits a step): b and c (0.8) go first, in order
    d.after_step([verify(a)], {"a": [9]}, {}, [a, b, c])
    assert (a.draft_token_ids, b.draft_token_ids, c.draft_token_ids) == ([], [3, 4, 5], [3])
    # b keeps one (0.65: one draft pays): c comes first
    d.after_step([verify(b)], {"b": [3, 9]}, {}, [a, b, c])
    assert (a.draft_token_ids, b.draft_token_ids, c.draft_token_ids) == ([], [3], [3, 4, 5])
