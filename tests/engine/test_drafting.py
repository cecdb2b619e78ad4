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
    # the latest occurrence wins, and the drafts may run to the last token
    r = decoding([1, 2, 3, 1, 2, 4, 1, 2])
    assert propose(Drafter(SpeculativeConfig(prompt_lookup_min=2)), r) == [4, 1, 2]
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


def test_a_request_drafts_one_more_than_it_kept_and_backs_off_after_misses():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2)
    d = Drafter(config)
    r = decoding([1, 2, 3, 4, 5, 6, 1, 2])
    assert propose(d, r) == [3, 4, 5, 6]

    def verify(drafts, kept):
        chunk = ScheduledChunk(r, r.num_computed_tokens, 1 + len(drafts), True, False, drafts)
        d.after_step([chunk], {"r": kept}, {}, [r])

    verify([3, 4, 5, 6], [3, 9])  # one kept: next time two
    assert r.draft_token_ids == [3, 4] and d.num_accepted_tokens == 1
    verify([3, 4], [8])  # none kept: wait a step, then draft one
    assert r.draft_token_ids == []
    d.after_step([], {}, {}, [r])
    assert r.draft_token_ids == [3]
    verify([3], [8])  # none again: wait two steps
    assert r.draft_token_ids == [] and [propose(d, r) for _ in range(2)] == [[], [3]]
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens) == (3, 7, 1)
    assert dict(d.accepted_per_position) == {0: 1}


def test_accepted_drafts_is_the_common_prefix():
    assert accepted_drafts([1, 2, 3], [1, 2, 9]) == 2
    assert accepted_drafts([1, 2], [1, 2, 5]) == 2
    assert accepted_drafts([1, 2], [7]) == 0
    assert accepted_drafts([1, 2, 3], [1]) == 1  # the output ended at the first


def test_a_step_shares_its_rows_best_acceptance_first():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, max_step_rows=7)
    d = Drafter(config)
    a, b, c = (decoding([1, 2, 3, 4, 5, 6, 1, 2], request_id=x) for x in "abc")
    d.after_step([], {}, {}, [a, b, c])  # 3 decodes, 4 rows left for drafts: a, first, takes them all
    assert (a.draft_token_ids, b.draft_token_ids, c.draft_token_ids) == ([3, 4, 5, 6], [], [])

    def verify(r):
        drafts = r.draft_token_ids
        return ScheduledChunk(r, r.num_computed_tokens, 1 + len(drafts), True, False, drafts)

    # a keeps none (it waits a step, then drafts one): b and c, untried, go first, in running order
    d.after_step([verify(a)], {"a": [9]}, {}, [a, b, c])
    assert (a.draft_token_ids, b.draft_token_ids, c.draft_token_ids) == ([], [3, 4, 5, 6], [])
    # b keeps one (it would draft two next): c, untried, comes first and takes all four rows
    d.after_step([verify(b)], {"b": [3, 9]}, {}, [a, b, c])
    assert (a.draft_token_ids, b.draft_token_ids, c.draft_token_ids) == ([], [], [3, 4, 5, 6])
