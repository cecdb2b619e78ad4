import pytest

from server.engine.block_manager import BEHIND_WINDOW, BlockManager, blocks_for
from server.engine.request import SamplingParams
from server.engine.request_state import Request


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams())


def compute(bm: BlockManager, request: Request, num_tokens: int | None = None) -> None:
    """What the scheduler does after a step: the tokens now have K/V, so full blocks get indexed."""
    request.num_computed_tokens = request.num_tokens if num_tokens is None else num_tokens
    bm.cache_full_blocks(request)


def admit(bm: BlockManager, request: Request) -> int:
    """Allocate the whole sequence with its prefix hit; returns the number of hit tokens."""
    hit = bm.find_cached_prefix(request)
    assert bm.allocate(request, request.num_tokens, hit)
    return hit.num_blocks * bm.block_size


def slots(bm: BlockManager, request: Request) -> list[int]:
    bs = bm.block_size
    return [request.block_tables[0][p // bs] * bs + p % bs for p in range(request.num_tokens)]


@pytest.mark.timeout(30)
def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = make_request("a", list(range(10))), make_request("b", list(range(5)))
    assert bm.allocate(a, 10) and bm.allocate(b, 5)
    assert len(a.block_tables[0]) == 3 and len(b.block_tables[0]) == 2
    assert not set(a.block_tables[0]) & set(b.block_tables[0])
    assert bm.num_free_blocks == 3 and bm.usage == pytest.approx(5 / 8)
    # growing within the last block takes nothing; crossing into a new one takes one
    assert bm.allocate(a, 12) and len(a.block_tables[0]) == 3
    assert bm.allocate(a, 13) and len(a.block_tables[0]) == 4
    bm.check_invariants()
    bm.free(a)
    bm.free(b)
    assert a.block_tables == [] and b.block_tables == []
    assert bm.num_free_blocks == 8 and bm.usage == 0
    assert bm.ref_counts == [0] * 8
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(8)))
    assert bm.allocate(a, 8)
    b = make_request("b", list(range(100, 113)))
    assert not bm.allocate(b, 13)  # needs 4 blocks, 2 free
    assert b.block_tables == [] and bm.num_free_blocks == 2
    assert bm.prefix_cache_queries == 8  # only a's admission counted
    assert not bm.allocate(a, 17)
    assert len(a.block_tables[0]) == 2
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_shared_blocks_are_ref_counted():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))
    a = make_request("a", prompt)
    admit(bm, a)
    compute(bm, a)
    b = make_request("b", prompt)
    assert admit(bm, b) == 8
    assert b.block_tables[0][:2] == a.block_tables[0][:2] and b.block_tables[0][2] != a.block_tables[0][2]
    assert [bm.ref_counts[i] for i in a.block_tables[0]] == [2, 2, 1]
    bm.free(a)
    assert [bm.ref_counts[i] for i in b.block_tables[0]] == [1, 1, 1]
    bm.free(b)
    assert bm.ref_counts == [0] * 8
    assert bm.num_free_blocks == 8
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_a_block_is_never_freed_twice():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(4)))
    assert bm.allocate(a, 4)
    stale_table = list(a.block_tables[0])
    bm.free(a)
    bm.free(a)  # the table is cleared on free, so a second free is harmless
    assert bm.num_free_blocks == 4
    a.block_tables = [stale_table]  # a caller that kept a stale table must trip the invariant
    with pytest.raises(AssertionError, match="freed more often"):
        bm.free(a)


@pytest.mark.timeout(30)
def test_prefix_hits_are_counted_in_tokens_and_leave_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(10)))
    assert admit(bm, a) == 0
    compute(bm, a)
    bm.free(a)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)

    b = make_request("b", list(range(10)))
    assert admit(bm, b) == 8  # 2 full blocks; the partial third is never shared
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)
    bm.free(b)

    # a prompt that is exactly two cached blocks still computes its last token: the hit is capped to one block
    c = make_request("c", list(range(8)))
    assert admit(bm, c) == 4
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (28, 12)
    bm.free(c)
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_a_diverging_prompt_reuses_only_the_shared_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(16)))
    admit(bm, a)
    compute(bm, a)
    # shares 6 tokens: one full block, then diverges inside the second
    b = make_request("b", list(range(6)) + [99] * 10)
    assert admit(bm, b) == 4
    assert b.block_tables[0][0] == a.block_tables[0][0]
    assert not set(b.block_tables[0][1:]) & set(a.block_tables[0])
    # the same tokens after a different first block are a different block: hashes are chained
    c = make_request("c", [99, 99, 99, 99] + list(range(4, 16)))
    assert admit(bm, c) == 0
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_blocks_filled_by_generated_tokens_are_cached():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3])
    assert bm.allocate(a, 3)
    compute(bm, a)
    for token in [4, 5, 6, 7, 8]:  # decode: each sampled token is fed back in the next step
        a.output_token_ids.append(token)
        assert bm.allocate(a, a.num_tokens)
        compute(bm, a)
    bm.free(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(bm, b) == 8


@pytest.mark.timeout(30)
def test_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])  # blocks [1,2] [3,4] full, [5] partial
    admit(bm, a)
    compute(bm, a)
    a_full = a.block_tables[0][:2]
    bm.free(a)
    b = make_request("b", [6, 7, 8])
    admit(bm, b)
    compute(bm, b)
    b_full = b.block_tables[0][0]
    bm.free(b)
    # cached, oldest first: a's tail before a's head (freed in reverse), then b
    assert list(bm.cached_block_ids) == [a_full[1], a_full[0], b_full]
    assert bm.num_free_blocks == 4 and bm.usage == 0

    # hitting a's head refreshes it; a newcomer needing 3 fresh blocks evicts a's tail and then b
    d = make_request("d", [1, 2, 50, 51, 52, 53, 54])
    assert admit(bm, d) == 2
    assert d.block_tables[0][0] == a_full[0]
    assert bm.find_cached_prefix(make_request("probe-a", [1, 2, 3, 4, 5])).tables[0] == [a_full[0]]
    assert bm.find_cached_prefix(make_request("probe-b", [6, 7, 8])).tables[0] == []
    assert len(bm.hash_to_block) == 1  # evicted blocks dropped their hash entries
    bm.free(d)
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_usage_returns_to_zero_with_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    reqs = [make_request(str(i), [i] * 7) for i in range(2)]
    for r in reqs:
        admit(bm, r)
        compute(bm, r)
    assert bm.usage == pytest.approx(8 / 8)
    for r in reqs:
        bm.free(r)
    assert len(bm.cached_block_ids) == 6
    assert bm.usage == 0 and bm.num_free_blocks == 8
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_fragmented_free_list_gives_non_contiguous_tables():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b, c = (make_request(n, list(range(8))) for n in "abc")
    for r in (a, b, c):
        assert bm.allocate(r, 8)
    bm.free(b)
    d = make_request("d", list(range(16)))
    assert bm.allocate(d, 16)
    assert b.block_tables == []
    # b's blocks first, whose pages are written (the process holds them: model/kv_cache.py), in table order as
    # they were released tail first; then the pool's never-used tail
    assert d.block_tables[0] == [2, 3, 6, 7]
    live = [slots(bm, r) for r in (a, c, d)]
    flat = [s for ss in live for s in ss]
    assert len(flat) == len(set(flat)) == 32  # every position has its own slot
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_blocks_written_before_are_handed_out_before_the_pools_untouched_ones():
    """On CPU the pool is held page by page as blocks are first written (model/kv_cache.py): what the process
    holds is the blocks handed out since start, which stays the most held at once, live and cached."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a, b = make_request("a", list(range(10))), make_request("b", list(range(100, 108)))
    admit(bm, a)
    admit(bm, b)
    assert bm.num_blocks_touched == 5
    compute(bm, a)
    bm.free(a)  # two full blocks cached, the partial third free
    bm.free(b)  # b never computed: both free
    assert bm.num_blocks_touched == 5
    c = make_request("c", list(range(200, 220)))  # 5 blocks: the 3 free ones written before, then 2 new
    admit(bm, c)
    assert sorted(c.block_tables[0]) == [2, 3, 4, 5, 6] and bm.num_blocks_touched == 7
    d = make_request("d", list(range(10)))  # a's cached prefix, then a block never written
    assert admit(bm, d) == 8
    assert d.block_tables[0] == [0, 1, 7] and bm.num_blocks_touched == 8
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_without_prefix_caching_nothing_is_hashed_or_reused():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    bm.free(a)
    assert bm.hash_to_block == {} and not bm.cached_block_ids
    b = make_request("b", [1, 2, 3, 4, 5])
    assert admit(bm, b) == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


@pytest.mark.timeout(30)
def test_identical_blocks_computed_at_once_keep_one_cached_copy():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a, b = make_request("a", [1, 2, 3]), make_request("b", [1, 2, 3])
    admit(bm, a)
    admit(bm, b)  # before a is computed: no hit, its own copy
    compute(bm, a)
    compute(bm, b)
    assert len(bm.hash_to_block) == 1
    bm.free(a)
    bm.free(b)
    assert len(bm.cached_block_ids) == 1 and bm.num_free_blocks == 8
    bm.check_invariants()


def held(bm: BlockManager) -> int:
    return sum(ref > 0 for ref in bm.ref_counts)


@pytest.mark.timeout(30)
def test_a_sliding_window_group_gives_back_the_blocks_behind_its_window():
    """A full-attention group keeps every block; a sliding one (window 8, blocks of 4) keeps those that a query from
    the computed tokens on reads, however long the sequence grows; the rest go back to the pool as it advances."""
    bm = BlockManager(num_blocks=40, block_size=4, enable_prefix_caching=True, windows=(None, 8))
    a = make_request("a", list(range(40)))
    for n in range(8, 41, 8):  # prefilled 8 tokens a step
        assert bm.allocate(a, n)
        compute(bm, a, n)
        bm.release_behind_window(a)
        full, sliding = a.block_tables
        first = (n - 8 + 1) // 4  # the block of the first key that the query at position n reads
        assert full == [b for b in full if b != BEHIND_WINDOW] and len(full) == n // 4
        assert sliding[:first] == [BEHIND_WINDOW] * first and BEHIND_WINDOW not in sliding[first:]
        assert held(bm) == n // 4 + len(sliding) - first <= n // 4 + 3
        bm.check_invariants()
    bm.free(a)
    assert held(bm) == 0 and bm.num_free_blocks == 40
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_a_prefix_hit_needs_a_sliding_groups_blocks_only_within_its_window():
    """A later prompt resumes after a cached prefix when every full-attention block of it is cached and the sliding
    group's within the window of its end; blocks further back may be gone (BEHIND_WINDOW in its table). Where the
    window's blocks are gone, the hit is shorter (here none)."""
    bm = BlockManager(num_blocks=42, block_size=4, enable_prefix_caching=True, windows=(None, 8))
    a = make_request("a", list(range(40)))
    for n in range(8, 41, 8):
        assert bm.allocate(a, n)
        compute(bm, a, n)
        bm.release_behind_window(a)  # blocks 0..7 of the sliding group go back (cached) on the way
    full, sliding = (list(t) for t in a.block_tables)
    bm.free(a)
    # a filler takes the 22 never-used blocks and evicts the 6 least recently used: sliding ones (0..5)
    assert bm.allocate(make_request("filler", list(range(1000, 1056))), 56)
    turn2 = make_request("turn2", list(range(40)) + [7])
    hit = bm.find_cached_prefix(turn2)
    assert hit.num_blocks == 10 and hit.tables == [full, [BEHIND_WINDOW] * 8 + sliding[8:]]
    assert admit(bm, turn2) == 40 and turn2.block_tables[1][:8] == [BEHIND_WINDOW] * 8
    # the first 24 tokens' full blocks are cached, but the sliding blocks their window reads (4, 5) are gone
    shorter = make_request("shorter", list(range(24)) + [7])
    assert bm.find_cached_prefix(shorter).num_blocks == 0
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_the_blocks_one_request_holds_at_most():
    """What admission checks a request against: a full group's blocks for every token, a sliding group's for its
    window and a chunk. Gemma 3 270M at 8k tokens (1 full group and 5 sliding of window 512, chunks of 2,048):
    1,317 blocks of 16 where all-full would need 3,072."""
    assert blocks_for([None] + [512] * 5, 16, 8192, 2048) == 512 + 5 * 161
    assert blocks_for([None, 8], 4, 40, 8) == 10 + 5
    assert blocks_for([None, 8], 4, 12, 8) == 3 + 3  # a short one holds all its blocks either way


@pytest.mark.timeout(30)
def test_blocks_of_generated_tokens_are_no_prompts_hit_where_prompts_are_computed_apart():
    """With outputs_apart (the amx tier's prompt GEMMs: a prompt's tokens and generated ones have K/V of other
    bits), a request's blocks that hold generated tokens are cached apart: another request whose prompt holds the
    same tokens computes them, and only the blocks of prompt tokens are its hit; the request itself, recomputed
    after a preemption, hits them all. Without it, the same tokens are the same block either way."""
    for apart in (True, False):
        bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, outputs_apart=apart)
        a = make_request("a", list(range(6)))
        admit(bm, a)
        # blocks 0 (prompt), 1 (2 prompt tokens, 2 generated), 2 (generated)
        a.output_token_ids.extend([50, 51, 52, 53, 54, 55])
        assert bm.allocate(a, a.num_tokens)
        compute(bm, a)
        bm.free(a)
        b = make_request("b", list(range(6)) + [50, 51, 52, 53, 54, 55, 56])
        assert admit(bm, b) == (4 if apart else 12)
        bm.free(b)
        resumed = bm.find_cached_prefix(a)  # a's own tokens, as a preempted request recomputes them
        # its 12 tokens but the last block: one token is left to compute
        assert resumed.num_blocks * bm.block_size == 8
        bm.check_invariants()
