import random
from collections.abc import Callable

import pytest

from server.engine.config import EngineConfig
from server.engine.request import FinishReason, SamplingParams
from server.engine.request_state import Request, RequestStatus
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.stopping import finish_reason

EOS = 2
FILLER = 7  # a token that stops nothing


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = True,
    max_model_len: int = 1024,
) -> Scheduler:
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
    )
    return Scheduler(config, num_blocks=num_blocks, max_model_len=max_model_len)


def make_request(request_id: str, prompt: int | list[int], max_tokens: int = 8, **params) -> Request:
    # an int asks for that many tokens, distinct per request id so that nothing hits the prefix cache by accident
    base = 1000 * sum(map(ord, request_id))
    prompt_ids = list(range(base, base + prompt)) if isinstance(prompt, int) else prompt
    return Request(request_id, prompt_ids, SamplingParams(max_tokens=max_tokens, **params), frozenset({EOS}))


def step(
    sched: Scheduler, token: Callable[[Request], int] = lambda r: FILLER
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake model: every request whose chunk reaches its end gets token(request), and
    the output stage's token rules decide who finished. Returns the finished requests too."""
    out = sched.schedule()
    sampled = {c.request.request_id: token(c.request) for c in out.chunks if c.sample}
    finished = decide(sched, out, sampled)
    sched.update(out, {rid: [t] for rid, t in sampled.items()}, finished)
    return out, [c.request for c in out.chunks if c.request.request_id in finished]


def decide(sched: Scheduler, out: SchedulerOutput, sampled: dict[str, int]) -> dict[str, FinishReason]:
    """What the output stage decides from the token rules alone (no stop strings here)."""
    reasons = {c.request.request_id: finish_reason(c.request, sampled[c.request.request_id],
                                                   len(c.request.output_token_ids) + 1, sched.max_model_len)
               for c in out.chunks if c.request.request_id in sampled}  # fmt: skip
    return {rid: r for rid, r in reasons.items() if r is not None}


def pairs(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.request.request_id, c.num_tokens) for c in out.chunks]


def run_to_end(
    sched: Scheduler, token: Callable[[Request], int] = lambda r: FILLER, max_steps: int = 1000
) -> int:
    for num_steps in range(max_steps):
        if not sched.has_unfinished_requests():
            return num_steps
        step(sched, token)
    raise AssertionError("requests did not finish")


def assert_all_blocks_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_decodes_are_scheduled_before_prefills():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    assert pairs(step(sched)[0]) == [("a", 4)]
    sched.add_request(make_request("b", 10))
    out, _ = step(sched)
    assert pairs(out) == [("a", 1), ("b", 10)]
    assert out.num_batched_tokens == 11


@pytest.mark.timeout(30)
def test_a_long_prompt_is_chunked_while_decodes_keep_flowing():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 2, max_tokens=20)
    sched.add_request(a)
    step(sched)
    b = make_request("b", 20)
    sched.add_request(b)
    history = []
    for _ in range(3):
        out, _ = step(sched)
        assert out.num_batched_tokens <= 8
        history.append(pairs(out))
    assert history == [[("a", 1), ("b", 7)], [("a", 1), ("b", 7)], [("a", 1), ("b", 6)]]
    assert len(a.output_token_ids) == 4  # one token per step, prefill or not
    assert len(b.output_token_ids) == 1  # sampled only once its whole prompt was computed
    assert b.num_computed_tokens == 20


@pytest.mark.timeout(30)
def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(str(i), 3, max_tokens=2 + i))
    out, _ = step(sched)
    assert pairs(out) == [("0", 3), ("1", 3)]
    assert (sched.num_running, sched.num_waiting) == (2, 2)
    out, finished = step(sched)
    assert [r.request_id for r in finished] == ["0"]
    out, _ = step(sched)
    assert pairs(out) == [("1", 1), ("2", 3)]
    run_to_end(sched)
    assert_all_blocks_free(sched)


@pytest.mark.timeout(30)
def test_waiting_requests_are_admitted_in_arrival_order():
    # 6 blocks of 4: "a" holds 4 blocks once decoding, "b" needs 4 and waits; "c" would fit but must not overtake
    sched = make_scheduler(num_blocks=6, block_size=4)
    a, b, c = make_request("a", 12, max_tokens=3), make_request("b", 16, max_tokens=1), make_request("c", 2)
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    sched.add_request(c)
    out, _ = step(sched)
    assert pairs(out) == [("a", 1)]
    assert list(sched.waiting) == [b, c] and b.status == c.status == RequestStatus.WAITING
    out, finished = step(sched)
    assert finished == [a]
    out, _ = step(sched)
    assert pairs(out) == [("b", 16), ("c", 2)]  # a's blocks are back: b first, then c behind it
    run_to_end(sched)
    assert_all_blocks_free(sched)


@pytest.mark.timeout(30)
def test_a_request_arriving_during_decodes_joins_at_the_next_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10))
    step(sched)
    step(sched)
    sched.add_request(make_request("b", 3))
    out, _ = step(sched)
    assert pairs(out) == [("a", 1), ("b", 3)]
    out, _ = step(sched)
    assert pairs(out) == [("a", 1), ("b", 1)]


@pytest.mark.timeout(30)
def test_preemption_sends_the_newest_request_back_and_it_completes_later():
    # 4 blocks of 2 tokens; each request eventually needs 3 blocks, so both cannot decode to the end together
    sched = make_scheduler(num_blocks=4, block_size=2)
    a, b = make_request("a", 2, max_tokens=5), make_request("b", 2, max_tokens=5)
    sampled: dict[str, list[int]] = {"a": [], "b": []}

    def token(r: Request) -> int:
        t = 10 + len(r.output_token_ids) + (20 if r is b else 0)
        sampled[r.request_id].append(t)
        return t

    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        out, _ = step(sched, token)
        assert not out.preempted
    out, _ = step(sched, token)  # both need a third block and none is free: the newest, b, goes
    assert out.preempted == [b] and pairs(out) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and sched.waiting[0] is b
    assert b.block_tables == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == sampled["b"] == [30, 31, 32]  # kept across preemption

    run_to_end(sched, token)
    assert a.finish_reason == b.finish_reason == FinishReason.LENGTH
    assert a.output_token_ids == sampled["a"] == [10, 11, 12, 13, 14]
    assert b.output_token_ids == sampled["b"] == [30, 31, 32, 33, 34]
    assert b.num_preemptions == 1 and sched.num_preemptions == 1 and sched.stats().num_preemptions == 1
    # the recompute was not counted again as a prefix-cache query
    assert sched.block_manager.prefix_cache_queries == 4
    assert_all_blocks_free(sched)


@pytest.mark.timeout(30)
def test_a_prefill_chunk_that_cannot_get_a_block_preempts_itself():
    # 3 blocks of 4, budget 5. "a" decodes inside its one block; "b" (newest) prefills 12 tokens in chunks of 4
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=5)
    a, b = make_request("a", 1, max_tokens=3), make_request("b", 12, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    assert pairs(step(sched)[0]) == [("a", 1), ("b", 4)]
    assert pairs(step(sched)[0]) == [("a", 1), ("b", 4)]
    out, finished = step(sched)  # b's third chunk needs a third block of its own: none is free
    assert out.preempted == [b] and pairs(out) == [("a", 1)] and finished == [a]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    out, finished = step(sched)  # back with its two full blocks from the prefix cache: only 4 tokens left
    assert pairs(out) == [("b", 4)] and finished == [b]
    assert b.num_cached_tokens == 0  # a hit on resume is not a prefix-cache hit of the request
    assert sched.num_preemptions == 1
    assert_all_blocks_free(sched)


@pytest.mark.timeout(30)
def test_max_tokens_finishes_with_length():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=4)
    sched.add_request(r)
    finished_at = [i for i in range(4) if step(sched)[1]]
    assert finished_at == [3]
    assert r.finish_reason == FinishReason.LENGTH and len(r.output_token_ids) == 4
    assert r.status == RequestStatus.FINISHED
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


@pytest.mark.timeout(30)
def test_eos_and_stop_tokens_finish_with_stop():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=10)
    s = make_request("s", 3, max_tokens=10, stop_token_ids=[42])
    sched.add_request(r)
    sched.add_request(s)
    tokens = {"r": [5, 6, EOS], "s": [42]}
    run_to_end(sched, lambda req: tokens[req.request_id].pop(0))
    assert r.finish_reason == s.finish_reason == FinishReason.STOP
    assert r.output_token_ids == [5, 6, EOS]  # the stop token is kept; the detokenizer hides it
    assert s.output_token_ids == [42]
    assert_all_blocks_free(sched)


@pytest.mark.timeout(30)
def test_min_tokens_suppresses_an_early_eos():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=10, min_tokens=3, stop_token_ids=[42])
    sched.add_request(r)
    tokens = [EOS, 42, EOS, 9]
    run_to_end(sched, lambda req: tokens.pop(0))
    assert r.output_token_ids == [EOS, 42, EOS] and r.finish_reason == FinishReason.STOP


@pytest.mark.timeout(30)
def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=5, ignore_eos=True)
    sched.add_request(r)
    run_to_end(sched, lambda req: EOS)
    assert r.output_token_ids == [EOS] * 5 and r.finish_reason == FinishReason.LENGTH


@pytest.mark.timeout(30)
def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=8)
    # check_fits would refuse this one; the scheduler still caps it
    r = make_request("r", 6, max_tokens=10)
    sched.add_request(r)
    run_to_end(sched)
    assert r.num_tokens == 8 and r.finish_reason == FinishReason.LENGTH


@pytest.mark.timeout(30)
def test_abort_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    a, b = make_request("a", 10), make_request("b", 10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.block_manager.usage > 0
    assert sched.abort_request("a") is a
    assert a.finish_reason == FinishReason.ABORT and a.is_finished and a.block_tables == []
    assert sched.block_manager.usage == 0 and sched.num_running == 0
    assert sched.abort_request("b") is b and sched.num_waiting == 0
    assert sched.abort_request("b") is None and sched.abort_request("nobody") is None
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


@pytest.mark.timeout(30)
def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort_request("a")
    sched.update(out, {"a": [FILLER], "b": [FILLER]}, {"b": FinishReason.STOP})  # as on a stop string
    assert a.output_token_ids == [] and b.output_token_ids == [FILLER]
    assert a.finish_reason == FinishReason.ABORT
    assert b.finish_reason == FinishReason.STOP and not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


@pytest.mark.timeout(30)
def test_check_fits_refuses_with_the_numbers():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    assert sched.check_fits(10, 7) is None  # 16 slots: exactly the cache
    too_long = sched.check_fits(90, 20)
    assert too_long is not None and all(str(n) in too_long for n in (90, 20, 110, 100))
    too_big = sched.check_fits(10, 8)
    assert too_big is not None and all(str(n) in too_big for n in (10, 8, 5, 4, 16))
    assert sched.check_fits(0, 8) is not None


@pytest.mark.timeout(30)
def test_prefix_cache_hit_skips_the_cached_tokens():
    sched = make_scheduler(block_size=4)
    prompt = list(range(1, 11))
    a = make_request("a", prompt, max_tokens=1)
    sched.add_request(a)
    run_to_end(sched)
    b = make_request("b", prompt, max_tokens=2)
    sched.add_request(b)
    out, _ = step(sched)
    assert pairs(out) == [("b", 2)] and b.num_cached_tokens == 8
    run_to_end(sched)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert stats.num_prompt_tokens == 20 and stats.num_generation_tokens == 3
    assert stats.kv_cache_usage == 0 and stats.num_running == stats.num_waiting == 0

    # a request asking for prompt logprobs computes its whole prompt
    c = make_request("c", prompt, max_tokens=1, prompt_logprobs=True)
    sched.add_request(c)
    out, _ = step(sched)
    assert pairs(out) == [("c", 10)] and c.num_cached_tokens == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_finish_cleanly(seed: int):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    sched = make_scheduler(
        num_blocks=rng.randint(6, 24),
        block_size=block_size,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(1, 24),
        enable_prefix_caching=seed % 3 != 0,
        max_model_len=64,
    )
    bm = sched.block_manager
    bases = [[rng.randint(0, 5) for _ in range(12)] for _ in range(3)]  # shared heads make prefix hits
    kv: dict[int, tuple[int, int]] = {}  # fake KV cache: slot -> (position, token) written there
    requests: list[Request] = []
    sampled: dict[str, list[int]] = {}

    def slot(r: Request, p: int) -> int:
        return r.block_tables[0][p // block_size] * block_size + p % block_size

    for _ in range(3000):
        if len(requests) < 40 and rng.random() < 0.3:
            tail = [rng.randint(0, 5) for _ in range(rng.randint(1, 10))]
            prompt = rng.choice(bases)[: rng.randint(0, 12)] + tail
            max_tokens = rng.randint(1, 12)
            params = dict(ignore_eos=rng.random() < 0.2, min_tokens=rng.randint(0, max_tokens))
            r = make_request(str(len(requests)), prompt, max_tokens, **params)
            if sched.check_fits(r.num_prompt_tokens, max_tokens) is None:
                sched.add_request(r)
                requests.append(r)
                sampled[r.request_id] = []
        if rng.random() < 0.02 and sched.requests:
            sched.abort_request(rng.choice(list(sched.requests)))
        if not sched.has_unfinished_requests() and len(requests) >= 40:
            break

        out = sched.schedule()
        config = sched.config
        scheduled = [(c.request, c.start, c.num_tokens) for c in out.chunks]
        assert out.num_batched_tokens == sum(n for _, _, n in scheduled) <= config.max_num_batched_tokens
        assert len(scheduled) <= sched.num_running <= config.max_num_seqs
        assert len({r.request_id for r, _, _ in scheduled}) == len(scheduled)
        # ref counts match the live block tables; a block in two tables is a shared, cached, full block
        holders: dict[int, int] = {}
        for r in sched.running:
            for b in r.block_tables[0]:
                holders[b] = holders.get(b, 0) + 1
        assert all(bm.ref_counts[b] == holders.get(b, 0) for b in range(bm.num_blocks))
        assert all(n == 1 or bm.block_hashes[b] is not None for b, n in holders.items())
        assert all(not r.block_tables for r in sched.waiting)
        # the fake model: write the chunk's K/V, only ever into unshared blocks, then read the whole context back
        written = set()
        for r, start, n in scheduled:
            # schedule() counts the chunk computed at once
            assert r.num_computed_tokens == start + n <= r.num_tokens and n >= 1
            tokens = r.all_token_ids
            for p in range(start, start + n):
                s = slot(r, p)
                block_id = r.block_tables[0][p // block_size]
                assert s not in written and bm.ref_counts[block_id] == 1 and bm.block_hashes[block_id] is None
                written.add(s)
                kv[s] = (p, tokens[p])
        for r, _, _ in scheduled:
            tokens = r.all_token_ids
            assert all(kv[slot(r, p)] == (p, tokens[p]) for p in range(r.num_computed_tokens))
        tokens_out = {c.request.request_id: rng.choice([EOS, 3, 4, 5]) for c in out.chunks if c.sample}
        for rid, t in tokens_out.items():
            sampled[rid].append(t)
        sched.update(out, {rid: [t] for rid, t in tokens_out.items()}, decide(sched, out, tokens_out))
        bm.check_invariants()
        # why admission order puts decodes first: only the newest running request can be mid-prefill
        assert all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running[:-1])
    else:
        raise AssertionError("workload did not finish")

    assert not sched.running and not sched.waiting
    for r in requests:
        assert r.is_finished and r.output_token_ids == sampled[r.request_id]
        out_ids, p = r.output_token_ids, r.params
        if r.finish_reason == FinishReason.ABORT:
            continue
        assert 1 <= len(out_ids) <= p.max_tokens
        # it stopped at the first token allowed to stop it, or ran to max_tokens
        stops = [i for i, t in enumerate(out_ids) if i + 1 >= p.min_tokens and t == EOS and not p.ignore_eos]
        if stops:
            assert r.finish_reason == FinishReason.STOP and stops == [len(out_ids) - 1]
        else:
            assert r.finish_reason == FinishReason.LENGTH and len(out_ids) == p.max_tokens
    assert_all_blocks_free(sched)


@pytest.mark.timeout(30)
def test_a_decode_carries_its_drafts_and_keeps_only_what_the_draws_confirmed():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    r = make_request("a", 6, max_tokens=20)
    sched.add_request(r)
    step(sched)  # the prefill: 6 tokens computed, one drawn (7 known)
    r.draft_token_ids = [21, 22, 23, 24, 25, 26]
    out = sched.schedule()
    (c,) = out.chunks
    # the token budget (6) takes the last token and five drafts; slots for 12 tokens = 3 blocks
    assert (c.start, c.num_tokens, c.drafts, c.is_decode) == (6, 6, [21, 22, 23, 24, 25], True)
    assert len(r.block_tables[0]) == 3 and out.num_batched_tokens == 6
    sched.update(out, {"a": [21, 22, 9]}, {})  # two drafts confirmed, then another draw
    assert r.output_token_ids == [FILLER, 21, 22, 9]
    assert r.num_computed_tokens == 9 == r.num_tokens - 1  # the last token and the two confirmed drafts
    assert len(r.block_tables[0]) == 3  # 10 tokens still need 3 blocks
    bm = sched.block_manager
    assert len(bm.request_hashes["a"]) == 2  # only blocks full of computed, kept tokens are hashed
    r.draft_token_ids = [5, 6]
    out = sched.schedule()
    sched.update(out, {"a": [7]}, {})  # none confirmed: the block held for them goes back
    assert r.num_computed_tokens == 10 and len(r.block_tables[0]) == 3
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_drafts_shrink_to_the_free_blocks_and_never_preempt():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    a, b = make_request("a", 3, max_tokens=8), make_request("b", 3, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # both prefilled: a holds 1 block (4 known tokens), b 1, one block free
    a.draft_token_ids = [1, 2, 3, 4, 5, 6]
    out = sched.schedule()
    assert [(c.request.request_id, c.drafts) for c in out.chunks] == [("a", [1, 2, 3, 4]), ("b", [])]
    assert not out.preempted and sched.block_manager.num_free_blocks == 0
